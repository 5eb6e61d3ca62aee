"""Test stand-in: the names openrlhf.models.ring_attn_utils imports; never called by the tested paths."""


def _not_here(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.bert_padding.{name} is a test stand-in (packing/ring attention is not tested)")

    fn.__name__ = name
    return fn


index_first_axis = _not_here("index_first_axis")
pad_input = _not_here("pad_input")
rearrange = _not_here("rearrange")
unpad_input = _not_here("unpad_input")
