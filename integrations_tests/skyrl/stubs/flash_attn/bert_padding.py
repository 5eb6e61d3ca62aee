"""flash_attn.bert_padding stand-in: each helper raises if it is ever called (sample packing is off in the tests)."""


def _absent(name):
    def helper(*args, **kwargs):
        raise RuntimeError(f"flash_attn.bert_padding.{name} is a test import stand-in (set "
                           "trainer.use_sample_packing=false on CPU)")

    helper.__name__ = name
    return helper


pad_input = _absent("pad_input")
unpad_input = _absent("unpad_input")
index_first_axis = _absent("index_first_axis")
