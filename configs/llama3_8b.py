# Full fine-tuning of Llama-3-8B (or 3.1-8B) on one H200, from converted Hugging Face weights.
# First:
#   python convert.py hf2nano /path/to/Meta-Llama-3-8B-Instruct checkpoints/llama3_8b
#   python data/prepare.py --tokenizer checkpoints/llama3_8b/tokenizer.model --out data/cache/sft_llama3 your_sft.jsonl
require_cuda = True
init_from = "checkpoints/llama3_8b"
data_dir = "data/cache/sft_llama3"
out_dir = "out/llama3_8b"
max_seq_len = 4096
tokens_per_micro_step = 16384
grad_accum = 4
learning_rate = 1e-5
min_lr = 1e-6
weight_decay = 0.0
warmup_steps = 20
max_steps = 1000
eval_interval = 100
eval_tokens = 262144
checkpoint_interval = 200
log_interval = 1
