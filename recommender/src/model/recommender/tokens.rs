//! The token tables dynamic mode reads texts from, and the GPT-2 features of their rows. It
//! must not hold parameters: GPT-2's are the caller's.

use tch::{Kind, Tensor};

use crate::model::gpt2::Gpt2;

/// Token ids `[n, t]` (i64) and mask `[n, t]` (1 real, 0 pad, right-padded) of every row's
/// text, and each row's number of real tokens on the host (so a batch is cut to its longest
/// text without asking the device).
pub struct TokenTable {
    pub ids: Tensor,
    pub mask: Tensor,
    lengths: Vec<i64>,
}

impl TokenTable {
    /// The table of `ids` and `mask` (on the CPU, as the tokenizer makes them) on `device`.
    pub fn new(ids: &Tensor, mask: &Tensor, device: tch::Device) -> TokenTable {
        let lengths = Vec::<i64>::try_from(mask.to_device(tch::Device::Cpu).ne(0).sum_dim_intlist(
            -1,
            false,
            Kind::Int64,
        ))
        .unwrap_or_default();
        TokenTable {
            ids: ids.to_device(device),
            mask: mask.to_device(device),
            lengths,
        }
    }

    /// The longest real text among rows `ids` (at least 1): from the host's lengths when the
    /// ids are on the host, else read from the device (outside training's hot path).
    fn longest(&self, ids: &Tensor) -> i64 {
        let from_host = (ids.device() == tch::Device::Cpu)
            .then(|| Vec::<i64>::try_from(ids).ok())
            .flatten()
            .and_then(|rows| {
                rows.iter()
                    .map(|&r| usize::try_from(r).ok().and_then(|r| self.lengths.get(r)))
                    .try_fold(0i64, |m, l| l.map(|&l| m.max(l)))
            });
        let longest = from_host.unwrap_or_else(|| {
            let rows = ids.to_device(self.mask.device());
            let mask = self.mask.index_select(0, &rows);
            let longest = mask.ne(0).sum_dim_intlist(-1, false, Kind::Int64).max();
            runtime::host_read::scalar(&longest).map_or(1, |v| v as i64)
        });
        longest.max(1)
    }
}

/// GPT-2 features of rows `ids` of `table`: tokens cut to the longest real text among them,
/// last hidden state mean-pooled over real tokens, then normalised per row (no affine) and
/// scaled to norm about 1, so that the projected text starts at the scale of the ID embeddings.
pub(super) fn encode_rows(gpt2: &Gpt2, table: &TokenTable, ids: &Tensor, train: bool) -> Tensor {
    let device = table.ids.device();
    let longest = table.longest(ids);
    let rows = runtime::host_read::to_device(ids, device);
    let mask = table.mask.index_select(0, &rows).narrow(1, 0, longest);
    let tokens = table.ids.index_select(0, &rows).narrow(1, 0, longest);
    let hidden = gpt2.forward(&tokens, &mask, train);
    let pooled = Gpt2::mean_pool(&hidden, &mask);
    let width = pooled.size().last().copied().unwrap_or(1);
    let normed = pooled.layer_norm(
        [width].as_slice(),
        None::<Tensor>,
        None::<Tensor>,
        1e-5,
        false,
    );
    normed / (width as f64).sqrt()
}
