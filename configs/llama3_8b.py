# Full fine-tuning of Llama-3-8B (or 3.1-8B) on one H200, from converted Hugging Face weights.
# First:
#   python convert.py hf2nano /path/to/Meta-Llama-3-8B-Instruct checkpoints/llama3_8b
#   python data/prepare.py --tokenizer checkpoints/llama3_8b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
#
# Where the 141 GB go (8.03e9 parameters): bf16 weights 16 GB + fp32 AdamW moments 64 GB + the fp16 Kahan
# compensation that keeps the small updates bf16 would round away 16 GB = 96 GB. fp32 master weights would need
# 128 GB before any activation. Gradients are never all held: each weight is updated the moment its gradient is
# complete (optimizer_in_backward), which rules out gradient accumulation and global-norm clipping. Activations
# are ~3.5 MB per token (32 blocks x ~108 KB), so a step is 8K tokens (~28 GB); checkpoint_layers trades more for
# recompute. To keep clipping and accumulation instead (slower: every block recomputed, +16 GB of gradients):
#   --optimizer_in_backward=False --grad_clip=1.0 --grad_accum=4 --checkpoint_layers=32
require_cuda = True
# FP8 block Linears (DeepSeek-V3's 1 x 128 / 128 x 128 scales) where the GPU runs them, a Hopper (sm_90), faster than
# bf16; elsewhere the same run in bf16. Its loss matches bf16's from scratch and continued (BENCHMARKS.md, Loss).
import torch  # noqa: E402  (a config is plain Python; only its plain settings are read)
fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
init_from = "checkpoints/llama3_8b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_8b"
weights_dtype = "bfloat16"
optimizer_name = "adamw_kahan"
optimizer_in_backward = True
grad_accum = 1
grad_clip = 0.0
checkpoint_layers = 0
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
# A checkpoint with the optimizer state (resumable) is 96 GB on disk: weights 16 + fp32 moments 64 + Kahan 16.
# save_optimizer_state = False writes the weights alone, 16 GB, the result of the fine-tune (no resume). train.py
# checks the free space before each save and keeps the weights when the whole state does not fit.
save_optimizer_state = True
log_interval = 1
