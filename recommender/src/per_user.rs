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

/// Fewer users shared than this and no interval is given: the normal approximation needs a
/// sample of some size (Student's t at 29 degrees of freedom is within 4% of it).
pub const MIN_USERS: usize = 30;

/// How far one evaluation's mean of a metric is from another's over the same users, relative
/// to the other's, with its 95% confidence interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paired {
    /// Users evaluated by both.
    pub users: u64,
    /// `mean(ours) / mean(base) - 1` over them.
    pub change: f64,
    /// Half the interval's width: `change ± half_width`. Both means are estimated from the same
    /// users, so it is the ratio's (the delta method: the spread of `ours - R x base` per user,
    /// `R` the ratio of the means, over the base's mean), not the difference's over a fixed base.
    pub half_width: f64,
}

impl Paired {
    /// `-0.7%, 95% CI -3.5% to +2.0%`.
    pub fn relative_line(&self) -> String {
        let pct = |v: f64| v * 100.0;
        format!(
            "{:+.1}%, 95% CI {:+.1}% to {:+.1}%",
            pct(self.change),
            pct(self.change - self.half_width),
            pct(self.change + self.half_width)
        )
    }
}

/// `ours` against `base` on `metric` over the users both evaluated; `None` when either lacks
/// the metric, the tables are of different users, fewer than [`MIN_USERS`] are shared, or the
/// base's mean is not positive.
pub fn paired(ours: &UserMetrics, base: &UserMetrics, metric: &str) -> Option<Paired> {
    let (a, b) = (ours.column(metric)?, base.column(metric)?);
    if a.len() != b.len() {
        return None;
    }
    let pairs: Vec<(f64, f64)> = a
        .iter()
        .zip(&b)
        .filter_map(|(x, y)| Some(((*x)?, (*y)?)))
        .collect();
    if pairs.len() < MIN_USERS {
        return None;
    }
    let n = pairs.len() as f64;
    let mean = |f: &dyn Fn(&(f64, f64)) -> f64| pairs.iter().map(f).sum::<f64>() / n;
    let (ours_mean, base_mean) = (mean(&|p| p.0), mean(&|p| p.1));
    if base_mean <= 0.0 {
        return None;
    }
    let ratio = ours_mean / base_mean;
    // `ours - ratio x base` has mean 0 by construction.
    let var = pairs
        .iter()
        .map(|p| (p.0 - ratio * p.1).powi(2))
        .sum::<f64>()
        / (n - 1.0);
    Some(Paired {
        users: pairs.len() as u64,
        change: ratio - 1.0,
        half_width: Z95 * (var / n).sqrt() / base_mean,
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
    fn the_interval_is_the_change_give_or_take_1_96_standard_errors_of_the_ratio() {
        // 40 users at 0.5 for the base, ours 0.6 and 0.4 in turn, one more user only in ours:
        // no change, and each user 0.1 off it.
        let mut ours: Vec<f64> = (0..40).map(|u| [0.6, 0.4][u % 2]).collect();
        let mut base = vec![0.5; 40];
        ours.push(0.9);
        base.push(f64::NAN);
        let p = paired(&table(&ours), &table(&base), "ndcg@10").unwrap();
        assert_eq!(p.users, 40);
        assert!(p.change.abs() < 1e-12, "{p:?}");
        // Variance 0.01 x 40 / 39, standard error sqrt(that / 40), over the base's 0.5.
        let se = (0.01f64 / 39.0).sqrt() / 0.5;
        assert!(
            (p.half_width - 1.959_963_984_540_054 * se).abs() < 1e-12,
            "{p:?}"
        );
        assert_eq!(p.relative_line(), "+0.0%, 95% CI -6.3% to +6.3%");
    }

    #[test]
    fn ours_exactly_twice_the_base_for_every_user_is_plus_100_percent_with_no_doubt() {
        // Each user's difference varies (a difference over a fixed base would have a width);
        // the ratio does not.
        let base: Vec<f64> = (0..50).map(|u| 0.1 + 0.01 * u as f64).collect();
        let ours: Vec<f64> = base.iter().map(|b| 2.0 * b).collect();
        let p = paired(&table(&ours), &table(&base), "ndcg@10").unwrap();
        assert!((p.change - 1.0).abs() < 1e-12, "{p:?}");
        assert!(p.half_width < 1e-9, "{p:?}");
        assert_eq!(p.relative_line(), "+100.0%, 95% CI +100.0% to +100.0%");
    }

    #[test]
    fn too_few_shared_users_other_users_or_no_base_is_no_comparison() {
        let some = |n: usize, v: f64| table(&vec![v; n]);
        assert!(paired(&some(30, 0.4), &some(30, 0.3), "ndcg@10").is_some());
        let mut one_short = vec![0.4; 30];
        one_short[7] = f64::NAN;
        assert_eq!(paired(&table(&one_short), &some(30, 0.3), "ndcg@10"), None);
        assert_eq!(paired(&some(31, 0.4), &some(30, 0.3), "ndcg@10"), None);
        assert_eq!(paired(&some(30, 0.4), &some(30, 0.0), "ndcg@10"), None);
        assert_eq!(paired(&some(30, 0.4), &some(30, 0.3), "mrr@5"), None);
    }
}
