"""The policy and what trains it: loading models and tokenizers, LoRA, precision, the trainable module.

  models.py        load a model and its tokenizer (a preset, an HF dir, the built-in tiny model)
  local_models.py  model dirs built on this machine without the hub (SmolLM2 from its GGUF, random-init GPU presets)
  precision.py     dtypes and saving a model dir
  trainable.py     the policy (and value head) with its optimizer, plain or under DeepSpeed
  lora.py          LoRA adapters: attach, save, merge
  fits.py          what fits in memory: counts against the machine's bytes
  heap.py          memory a step frees kept for the next (no page faults per micro-batch)
"""
