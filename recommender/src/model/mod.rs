//! The recommender's models. This module owns the architectures: the text encoder (GPT-2, laid
//! out exactly like Hugging Face's `GPT2Model` so its safetensors load unchanged, and the GPT-2
//! tokenizer) and the recommender head (ID embeddings fused with text features, a scorer, BPR). It knows nothing about training, data-parallelism or checkpoints of its own: the
//! DDP engine, optimizer and checkpoint modules work on its `tch::nn::VarStore` like any other.

pub mod gpt2;
pub mod history;
pub mod recommender;

pub mod autocast;
