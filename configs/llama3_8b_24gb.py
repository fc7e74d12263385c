# Full fine-tuning of Llama-3-8B (or 3.1-8B) on one 24 GB GPU (RTX 3090 / 4090, A10, L4), from converted Hugging
# Face weights: configs/llama3_8b_80gb.py with the optimizer state in host memory and every block recomputed.
# First:
#   python convert.py hf2nano /path/to/Meta-Llama-3-8B-Instruct checkpoints/llama3_8b
#   python data/prepare.py --tokenizer checkpoints/llama3_8b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
#
# GPU memory (8.03e9 parameters): bf16 weights 16.1 GB; the block inputs of an 8K-token step 2.1 GB (all 32 blocks
# recompute in backward: ~33% more compute); the loss's lm_head gradient and chunked logits ~3 GB at its peak; one
# block's activations and gradients; StateStream's three 132 MiB slots: 22.1 GB measured at the peak. Host memory:
# the 8-bit moments, their scales and the fp16 Kahan compensation, 33.1 GB pinned (page-locked; the benchmark's
# process held 38 GB: the machine needs ~48 GB of RAM), streamed through the GPU during backward, 66 GB over the
# host link per step, hidden under the recompute where the GPU computes slower than the link moves it (speed:
# BENCHMARKS.md). The loss is the resident optimizer's to the bit (tests/test_optim8bit.py).
require_cuda = True
# FP8 block Linears where the GPU runs them, a Hopper (sm_90); elsewhere bf16 (as configs/llama3_8b.py)
import torch  # noqa: E402  (a config is plain Python; only its plain settings are read)
fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
init_from = "checkpoints/llama3_8b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_8b_24gb"
weights_dtype = "bfloat16"
optimizer_name = "adamw8bit"
optimizer_offload = 1.0
optimizer_in_backward = True
grad_accum = 1
grad_clip = 0.0
checkpoint_layers = 32
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
