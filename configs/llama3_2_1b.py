# Full fine-tuning of Llama-3.2-1B (or 1B-Instruct) from converted Hugging Face weights.
# First:
#   python convert.py hf2nano /path/to/Llama-3.2-1B-Instruct checkpoints/llama3_2_1b
#   python data/prepare.py --tokenizer checkpoints/llama3_2_1b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
require_cuda = True
init_from = "checkpoints/llama3_2_1b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_2_1b"
max_seq_len = 4096
tokens_per_micro_step = 16384
grad_accum = 4
learning_rate = 2e-5
min_lr = 2e-6
weight_decay = 0.0
warmup_steps = 20
max_steps = 1000
eval_interval = 100
eval_tokens = 262144
checkpoint_interval = 200
# A checkpoint with the optimizer state (resumable) is 15 GB on disk: fp32 weights 5 + AdamW moments 10.
# save_optimizer_state = False writes the weights alone, 5 GB (no resume).
save_optimizer_state = True
log_interval = 1
