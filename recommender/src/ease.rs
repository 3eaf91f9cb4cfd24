//! EASE (Steck, "Embarrassingly Shallow Autoencoders", WWW 2019), the closed-form item-item
//! baseline a recommender engineer fits first: `B = I - P diag(1 / diag(P))` with
//! `P = (XᵀX + λI)⁻¹`, `X` the users' training items, so a user's scores are the row of their
//! history times `B` (no item recommends itself). Printed beside popularity at the end of a
//! run, so a user sees at once whether training was worth it.
//!
//! Owns: the fit (Gram matrix from the users' item lists, one Cholesky inversion in f64) and the scores
//! of a batch of users. Must not: train anything, know ranks (every rank fits the same matrix
//! from the same split), or score what it was not fitted on (cold items score 0; a user
//! without training items scores 0 everywhere).

use tch::{Device, Kind, Tensor};

/// The most warm items EASE is fitted for: its matrices are items x items (8,192 items: 512 MiB
/// a matrix in f64, three of them at the inversion).
pub const MAX_ITEMS: usize = 8192;

/// A fitted EASE model over the warm items `0..n_warm` of a data set of `n_items` items.
pub struct Ease {
    /// `B`, `[n_warm, n_warm]`, f32.
    weights: Tensor,
    n_items: i64,
}

impl Ease {
    /// Fits EASE on `train` (per user, sorted warm item ids below `n_warm`) with the
    /// regularisation `reg` (RecBole's `reg_weight`, default 250); `None` when there are more
    /// than [`MAX_ITEMS`] warm items.
    pub fn fit(
        train: &[Vec<u32>],
        n_warm: u32,
        n_items: u32,
        reg: f64,
    ) -> Result<Option<Ease>, tch::TchError> {
        let n = n_warm as usize;
        if n > MAX_ITEMS || n == 0 {
            return Ok(None);
        }
        let mut gram = vec![0f64; n * n];
        for items in train {
            for &i in items {
                let row = &mut gram[i as usize * n..(i as usize + 1) * n];
                for &j in items {
                    row[j as usize] += 1.0;
                }
            }
        }
        for i in 0..n {
            gram[i * n + i] += reg;
        }
        let _guard = tch::no_grad_guard();
        let p = Tensor::f_from_slice(&gram)?
            .f_view([n as i64, n as i64])?
            // XᵀX + λI is symmetric positive definite: Cholesky, about half an LU's work.
            .f_linalg_cholesky(false)?
            .f_cholesky_inverse(false)?;
        // B_ij = -P_ij / P_jj, B_jj = 0.
        let diag = p.f_diagonal(0, 0, 1)?;
        let weights = p
            .f_div(&diag.f_unsqueeze(0)?)?
            .f_neg()?
            .f_fill_diagonal_(0.0, false)?
            .f_to_kind(Kind::Float)?
            .f_contiguous()?;
        Ok(Some(Ease {
            weights,
            n_items: i64::from(n_items),
        }))
    }

    /// The scores `[users.len(), n_items]` of `users` (their training items in `train`); cold
    /// items score 0.
    pub fn scores(&self, users: &[usize], train: &[Vec<u32>]) -> Result<Tensor, tch::TchError> {
        let n = self.weights.size()[0];
        let b = users.len() as i64;
        let mut history = vec![0f32; (b * n) as usize];
        for (row, &u) in users.iter().enumerate() {
            for &i in train.get(u).map_or(&[][..], Vec::as_slice) {
                history[row * n as usize + i as usize] = 1.0;
            }
        }
        let x = Tensor::f_from_slice(&history)?.f_view([b, n])?;
        let warm = x.f_matmul(&self.weights)?;
        let cold = Tensor::f_zeros([b, self.n_items - n], (Kind::Float, Device::Cpu))?;
        Tensor::f_cat(&[warm, cold], 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_matches_the_closed_form_and_never_recommends_an_item_to_itself() {
        // Items 0 and 1 always together, item 2 alone: a user with item 0 gets item 1 first.
        let train = vec![vec![0, 1], vec![0, 1], vec![2], vec![0, 1, 2]];
        let ease = Ease::fit(&train, 3, 4, 1.0).unwrap().unwrap();
        let b = Vec::<f32>::try_from(ease.weights.view([-1])).unwrap();
        // By hand: G + I = [[4,3,1],[3,4,1],[1,1,3]]; B_ij = -P_ij / P_jj.
        let g = Tensor::from_slice(&[4f64, 3., 1., 3., 4., 1., 1., 1., 3.]).view([3, 3]);
        let p = Vec::<f64>::try_from(g.inverse().reshape([-1])).unwrap();
        for i in 0..3 {
            for j in 0..3 {
                let want = if i == j {
                    0.0
                } else {
                    -p[i * 3 + j] / p[j * 3 + j]
                };
                assert!((f64::from(b[i * 3 + j]) - want).abs() < 1e-6, "B[{i}][{j}]");
            }
        }
        let s = Vec::<f32>::try_from(ease.scores(&[0, 1], &[vec![0], vec![]]).unwrap().view([-1]))
            .unwrap();
        assert_eq!(s.len(), 8);
        assert!(s[1] > s[2], "{s:?}");
        assert_eq!(s[3], 0.0, "a cold item scores 0");
        assert_eq!(
            &s[4..],
            &[0.0, 0.0, 0.0, 0.0],
            "a user without items scores 0: {s:?}"
        );
    }

    #[test]
    fn too_many_items_is_no_fit() {
        assert!(
            Ease::fit(&[], MAX_ITEMS as u32 + 1, MAX_ITEMS as u32 + 1, 250.0)
                .unwrap()
                .is_none()
        );
    }
}
