"""Import stand-in (SkyRL integration tests only): SkyRL's workers/model_wrapper.py imports
flash_attn.bert_padding at module level; its helpers run only with sample packing, which the tests turn off."""
