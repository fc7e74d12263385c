# Full fine-tuning of Llama-3-8B (or 3.1-8B) on one 80 GB GPU (A100 / H100 80GB), from converted Hugging Face
# weights: configs/llama3_8b.py with 8-bit Adam moments (optim.AdamW8bit).
# First:
#   python convert.py hf2nano /path/to/Meta-Llama-3-8B-Instruct checkpoints/llama3_8b
#   python data/prepare.py --tokenizer checkpoints/llama3_8b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
#
# Where the memory goes (8.03e9 parameters): bf16 weights 16.1 GB + 8-bit moments 16.1 GB (int8 codes of m, uint8
# codes of sqrt(v); their fp32 scales, one per 64 elements, 1.0 GB) + fp16 Kahan compensation 16.1 GB = 49.3 GB of
# training state, where fp32 moments make it 96.4 GB. Gradients are never all held (optimizer_in_backward: each
# weight is updated the moment its gradient is complete; no gradient accumulation, no global-norm clipping).
# Activations: ~3.5 MB per token without recompute (32 blocks x ~108 KB), so the 8K-token step of llama3_8b.py
# (32.4 GB above the state at its measured 128.8 GB peak) would peak near 81 GB here; recomputing the first 8
# blocks in backward (checkpoint_layers, ~0.8 GB each at 8K tokens; ~8% more compute) brings that to ~74 GB.
# Measured on an H200 (BENCHMARKS.md, 2026-12-01): these settings on the 8B shape peak at 74.9 GB at 11,240 tok/s
# (bench/e2e.py free_8bit); over 500 steps of the 1B shape the 8-bit moments end within 1.04% of fp32 moments'
# train loss, as close as two fp32 runs whose peak lr differs by 0.1% (bench/fidelity.py adamw8bit).
require_cuda = True
# FP8 block Linears (DeepSeek-V3's 1 x 128 / 128 x 128 scales) where the GPU runs them, a Hopper (sm_90), faster than
# bf16; elsewhere the same run in bf16. Its loss matches bf16's from scratch and continued (BENCHMARKS.md, Loss).
import torch  # noqa: E402  (a config is plain Python; only its plain settings are read)
fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
init_from = "checkpoints/llama3_8b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_8b_80gb"
weights_dtype = "bfloat16"
optimizer_name = "adamw8bit"
optimizer_in_backward = True
grad_accum = 1
grad_clip = 0.0
checkpoint_layers = 8
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
# A checkpoint with the optimizer state (resumable) is 49.3 GB on disk: weights 16.1 + 8-bit moments and their
# scales 17.1 + Kahan 16.1. save_optimizer_state = False writes the weights alone, 16.1 GB (no resume).
save_optimizer_state = True
log_interval = 1
