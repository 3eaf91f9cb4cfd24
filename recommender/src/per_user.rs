//! The paired comparison of two evaluations of the same users ([`paired`], from each one's
//! [`UserMetrics`]): the mean difference of a metric and its 95%
//! confidence interval over the users, so a run can say whether its lead over a baseline is
//! more than which users happened to be held out (on ML-100k's 941 test users a difference of
//! 1-2% NDCG@10 is within it).
//!
//! Owns: the interval's arithmetic. Must not: rank, know ranks or the model (the sharded
//! evaluation fills the tables; [`crate::eval`] owns their layout).

use crate::eval::UserMetrics;

/// The normal distribution's two-sided 95% quantile.
const Z95: f64 = 1.959_963_984_540_054;

/// The mean difference of a metric between two evaluations of the same users, and its 95%
/// confidence interval (the normal approximation: hundreds of users make it a fair one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    /// Users evaluated by both.
    pub users: u64,
    /// Mean of `ours - base` over them.
    pub mean: f64,
    /// Half the interval's width: `mean ± half_width`.
    pub half_width: f64,
    /// The base's mean over the same users (what a relative difference is of).
    pub base_mean: f64,
}

impl Paired {
    /// `-0.7%, 95% CI -3.4% to +2.0%`: relative to the base's mean.
    pub fn relative_line(&self) -> String {
        let rel = |v: f64| (v / self.base_mean) * 100.0;
        format!(
            "{:+.1}%, 95% CI {:+.1}% to {:+.1}%",
            rel(self.mean),
            rel(self.mean - self.half_width),
            rel(self.mean + self.half_width)
        )
    }
}

/// `ours - base` on `metric` over the users both evaluated; `None` when either lacks the
/// metric, fewer than two users are shared, or the base's mean is not positive.
pub fn paired(ours: &UserMetrics, base: &UserMetrics, metric: &str) -> Option<Paired> {
    let (a, b) = (ours.column(metric)?, base.column(metric)?);
    let pairs: Vec<(f64, f64)> = a
        .iter()
        .zip(&b)
        .filter_map(|(x, y)| Some(((*x)?, (*y)?)))
        .collect();
    let n = pairs.len() as f64;
    if pairs.len() < 2 {
        return None;
    }
    let base_mean = pairs.iter().map(|p| p.1).sum::<f64>() / n;
    let mean = pairs.iter().map(|p| p.0 - p.1).sum::<f64>() / n;
    let var = pairs
        .iter()
        .map(|p| (p.0 - p.1 - mean).powi(2))
        .sum::<f64>()
        / (n - 1.0);
    (base_mean > 0.0).then(|| Paired {
        users: pairs.len() as u64,
        mean,
        half_width: Z95 * (var / n).sqrt(),
        base_mean,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of one cut-off (10): each user's recall@10 0.5 and ndcg@10 from `ndcg` (`NaN`:
    /// the user was not evaluated).
    fn table(ndcg: &[f64]) -> UserMetrics {
        let row = |v: f64| match v.is_nan() {
            true => [f64::NAN; 5],
            false => [0.5, v, 0.0, 0.0, 0.0],
        };
        UserMetrics::new(&[10], ndcg.iter().flat_map(|&v| row(v)).collect())
    }

    #[test]
    fn a_column_reads_each_user_s_value_and_none_where_not_evaluated() {
        let t = table(&[0.25, f64::NAN, 1.0]);
        assert_eq!(t.column("NDCG@10"), Some(vec![Some(0.25), None, Some(1.0)]));
        assert_eq!(
            t.column("recall@10"),
            Some(vec![Some(0.5), None, Some(0.5)])
        );
        assert_eq!(t.column("ndcg@20"), None);
        assert_eq!(t.column("auc@10"), None);
    }

    #[test]
    fn the_interval_is_the_mean_difference_give_or_take_1_96_standard_errors() {
        // Differences 0.1, 0.3, 0.2, 0.2 over users both evaluated (user 2 is not in ours).
        let ours = table(&[0.5, 0.6, f64::NAN, 0.4, 0.3]);
        let base = table(&[0.4, 0.3, 0.9, 0.2, 0.1]);
        let p = paired(&ours, &base, "ndcg@10").unwrap();
        assert_eq!(p.users, 4);
        assert!((p.mean - 0.2).abs() < 1e-12, "{p:?}");
        assert!((p.base_mean - 0.25).abs() < 1e-12, "{p:?}");
        // Sample variance of (0.1, 0.3, 0.2, 0.2): 0.02 / 3; standard error sqrt(that / 4).
        let se = (0.02f64 / 3.0 / 4.0).sqrt();
        assert!(
            (p.half_width - 1.959_963_984_540_054 * se).abs() < 1e-12,
            "{p:?}"
        );
        assert_eq!(p.relative_line(), "+80.0%, 95% CI +48.0% to +112.0%");
    }

    #[test]
    fn too_few_shared_users_or_no_base_is_no_comparison() {
        let one = table(&[0.5, f64::NAN]);
        assert_eq!(paired(&one, &table(&[0.4, 0.3]), "ndcg@10"), None);
        let zero = table(&[0.0, 0.0]);
        assert_eq!(paired(&table(&[0.4, 0.3]), &zero, "ndcg@10"), None);
        assert_eq!(paired(&zero, &zero, "mrr@5"), None);
    }
}
