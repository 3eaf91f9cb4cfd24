//! The recommender's text encoder. This module owns the model architecture (GPT-2, laid out
//! exactly like Hugging Face's `GPT2Model` so its safetensors load unchanged) and the GPT-2
//! tokenizer. It knows nothing about training, data-parallelism or checkpoints of its own: the
//! DDP engine, optimizer and checkpoint modules work on its `tch::nn::VarStore` like any other.

pub mod gpt2;
