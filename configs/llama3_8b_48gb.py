# Full fine-tuning of Llama-3-8B (or 3.1-8B) on one 48 GB GPU (RTX A6000, L40S, A40), from converted Hugging
# Face weights: configs/llama3_8b_80gb.py with most of the optimizer state in host memory, half the blocks recomputed.
# First:
#   python convert.py hf2nano /path/to/Meta-Llama-3-8B-Instruct checkpoints/llama3_8b
#   python data/prepare.py --tokenizer checkpoints/llama3_8b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
#
# GPU memory (8.03e9 parameters): configs/llama3_8b_24gb.py's 22.1 GB, plus the activations of the 16 blocks that
# keep them (~0.85 GB each at 8K tokens), plus the 8-bit state of the first 30% of the parameters (the embedding,
# blocks 0-7 and half of block 8, 9.8 GB: backward updates them last, when no compute is left to hide their
# copies): 45.3 GB measured at the peak. Host memory: the state of the other 70%, 23.3 GB pinned (the benchmark's
# process held 28.3 GB), 47 GB over the host link per step. Why not all of it, with fewer blocks recomputed: state
# kept on the GPU saves two copies per byte over the link, a block not recomputed only compute (BENCHMARKS.md).
require_cuda = True
# FP8 block Linears where the GPU runs them, a Hopper (sm_90); elsewhere bf16 (as configs/llama3_8b.py)
import torch  # noqa: E402  (a config is plain Python; only its plain settings are read)
fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
init_from = "checkpoints/llama3_8b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_8b_48gb"
weights_dtype = "bfloat16"
optimizer_name = "adamw8bit"
optimizer_offload = 0.7
optimizer_in_backward = True
grad_accum = 1
grad_clip = 0.0
checkpoint_layers = 16
max_seq_len = 4096
tokens_per_micro_step = 8192
learning_rate = 1e-5
min_lr = 1e-6
weight_decay = 0.0
warmup_steps = 20
max_steps = 4000
eval_interval = 400
eval_tokens = 262144
checkpoint_interval = 500
# A checkpoint with the optimizer state (resumable) is 49.3 GB on disk (weights 16.1 + state 33.1);
# save_optimizer_state = False writes the weights alone, 16.1 GB (no resume).
save_optimizer_state = True
log_interval = 1
