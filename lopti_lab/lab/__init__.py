"""The lab model: a tiny Qwen2-architecture K&K reasoner that runs the whole experiment on a laptop CPU.

    trace      the supervised chain of thought (a search whose every decision is local, free wording, rare slips)
    tokenizer  byte-level BPE learned on K&K text, in transformers' own Qwen2Tokenizer
    model      the Qwen2 shape, and saving a lab model as a standard Hugging Face checkpoint with its model card
    pretrain   the supervised warm start (``lopti-lab pretrain``)
    evaluate   test accuracy, the token profile of its rollouts, an audit of its greedy traces

A lab model folder loads like any hub model (``models.load_policy("lab")`` or ``AutoModelForCausalLM``), so rollouts,
the trainer, LoRA and the probes run the same code as for Qwen2.5. docs/lab_model.md says how the bundled one was
designed, trained and measured.
"""
