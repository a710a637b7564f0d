"""Generating rollouts from the policy: the engines, mrl's native decoder and its CUDA-graph capture.

  rollout.py      `Rollouts`, the rollout engines' registry (`ROLLOUT_ENGINES`) and multi-turn episodes
  decoder.py      the native decoder: a KV cache of its own, finished rows dropped
  captured.py     the native decoder under captured CUDA graphs
  vllm_engine.py  vLLM in this process: the sampler behind rollout.engine=vllm
"""
