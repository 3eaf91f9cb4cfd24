//! The recommender's models. This module owns the architectures: the text encoder (GPT-2, laid
//! out exactly like Hugging Face's `GPT2Model` so its safetensors load unchanged, and the GPT-2
//! tokenizer) and the recommender head (ID embeddings fused with text features, a scorer, BPR). It knows nothing about training, data-parallelism or checkpoints of its own: the
//! DDP engine, optimizer and checkpoint modules work on its `tch::nn::VarStore` like any other.

pub mod gpt2;
pub mod recommender;

// libtorch's own setter for the autocast type (tch only switches autocast on, and CUDA's
// default type is f16, which needs loss scaling; bf16 does not). `DeviceType` and `ScalarType`
// are `int8_t` enums in C++.
extern "C" {
    #[link_name = "_ZN2at8autocast18set_autocast_dtypeEN3c1010DeviceTypeENS1_10ScalarTypeE"]
    fn at_autocast_set_dtype(device_type: i8, scalar_type: i8);
    #[link_name = "_ZN2at8autocast18get_autocast_dtypeEN3c1010DeviceTypeE"]
    fn at_autocast_get_dtype(device_type: i8) -> i8;
}

/// c10's `DeviceType::CUDA` and `ScalarType::BFloat16`.
const DEVICE_TYPE_CUDA: i8 = 1;
const SCALAR_TYPE_BFLOAT16: i8 = 15;

/// Makes CUDA autocast (`tch::autocast(true, ..)`) compute in bf16 for this process.
pub fn use_bf16_autocast() {
    // SAFETY: plain setters of libtorch's global autocast state, with valid enum values.
    unsafe { at_autocast_set_dtype(DEVICE_TYPE_CUDA, SCALAR_TYPE_BFLOAT16) }
}

/// Whether CUDA autocast computes in bf16 (see [`use_bf16_autocast`]).
pub fn bf16_autocast_is_set() -> bool {
    // SAFETY: a plain getter of libtorch's global autocast state.
    unsafe { at_autocast_get_dtype(DEVICE_TYPE_CUDA) == SCALAR_TYPE_BFLOAT16 }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_autocast_type_can_be_set_to_bf16() {
        // The call reaches libtorch on any machine; the type only matters on CUDA.
        super::use_bf16_autocast();
        assert!(super::bf16_autocast_is_set());
    }
}
