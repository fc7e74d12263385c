# Full fine-tuning of SmolLM2-135M (or -135M-Instruct) from converted Hugging Face weights: a teaching run sized for a
# laptop's CPU (30 steps of 2 x 1024 tokens, ~1.7 TFLOP of forward + backward each: minutes on a laptop's cores,
# seconds on a GPU).
# First:
#   python convert.py hf2nano /path/to/SmolLM2-135M-Instruct checkpoints/smollm2_135m
#   python data/prepare.py --tokenizer checkpoints/smollm2_135m --out data/cache/sft_smollm2 your_sft.jsonl
# (the checkpoint's tokenizer.json, SmolLM2's own: chats are rendered in ChatML, documents end with <|endoftext|>)
# On a GPU, bigger steps: --tokens_per_micro_step=16384 --max_seq_len=2048 --max_steps=300
init_from = "checkpoints/smollm2_135m"
data_dir = "data/cache/sft_smollm2"
out_dir = "out/smollm2_135m"
max_seq_len = 512  # longer documents are cut into pieces of this length
tokens_per_micro_step = 1024
grad_accum = 2
learning_rate = 1e-4
min_lr = 1e-5
weight_decay = 0.0
warmup_steps = 5
max_steps = 30
eval_interval = 10
eval_tokens = 4096
checkpoint_interval = 30
# the weights alone: 540 MB in fp32 (True: 1.6 GB with AdamW's moments, and the run can be resumed)
save_optimizer_state = False
log_interval = 1
