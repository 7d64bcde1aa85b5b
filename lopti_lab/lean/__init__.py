"""The CPU fast path: a lean batched decode loop (``decode``) and the lean Qwen2 forwards it and the update share
(``forward``: each prompt computed once for its group, an in-place KV cache). ``rollout`` chooses between them and
Hugging Face's generate and forward (``rollout.FAST_PATHS``); both give HF's tokens and log-probs up to rounding."""
