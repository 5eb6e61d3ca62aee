"""Test stand-in: vllm.distributed (the weight-sync group OpenRLHF builds with ``--vllm.sync_backend gloo``)."""
