//! Unit tests of `optim` (AdamW against hand-computed steps and PyTorch's rules, the schedules,
//! the saved state).

use super::*;

fn param(values: &[f32]) -> Tensor {
    Tensor::from_slice(values).set_requires_grad(true)
}

/// Sets `p.grad` to `g` (creating it through a backward pass the first time).
fn set_grad(p: &Tensor, g: &[f32]) {
    let g = Tensor::from_slice(g).reshape(p.size());
    let mut grad = p.grad();
    if grad.defined() {
        tch::no_grad(|| grad.copy_(&g));
    } else {
        (p * &g).sum(Kind::Float).backward();
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    let flat = t.detach().to_kind(Kind::Double).reshape([-1]);
    Vec::<f64>::try_from(&flat).unwrap()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
    }
}

#[test]
fn adamw_matches_hand_computed_two_steps() {
    let (beta1, beta2, eps, wd) = (0.9, 0.999, 1e-8, 0.1);
    let p0 = [1.0f32, -2.0, 0.5];
    let grads = [[0.5f32, -1.0, 0.25], [-0.3f32, 0.2, 2.0]];
    let lrs = [0.1, 0.05];

    let p = param(&p0);
    let mut opt = AdamW::new(&[p.shallow_clone()], beta1, beta2, eps, wd);
    for (g, &lr) in grads.iter().zip(&lrs) {
        set_grad(&p, g);
        opt.step(&[p.shallow_clone()], lr);
    }
    assert_eq!(opt.steps_taken(), 2);

    // Reference in plain f64.
    let mut want: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
    let mut m = [0.0f64; 3];
    let mut v = [0.0f64; 3];
    for (t, (g, &lr)) in grads.iter().zip(&lrs).enumerate() {
        let t = (t + 1) as i32;
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        for i in 0..3 {
            let gi = f64::from(g[i]);
            want[i] *= 1.0 - lr * wd;
            m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
            v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
            want[i] -= lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
        }
    }
    assert_close(&values(&p), &want, 1e-6);
    let state = opt.state_tensors();
    assert_close(&values(&state[0].1), &m, 1e-6);
    assert_close(&values(&state[1].1), &v, 1e-6);
}

/// The fused loop and the tensor ops compute the same update (to float rounding), with
/// either lerp formula (beta1 above and below 0.5) and with or without decay.
#[test]
fn fused_update_equals_tensor_ops() {
    for (beta1, wd) in [(0.9, 0.0), (0.9, 0.1), (0.3, 0.01)] {
        tch::manual_seed(7);
        let tensors = || -> [Tensor; 4] {
            let p = Tensor::randn([1000, 7], (Kind::Float, Device::Cpu));
            let g = Tensor::randn([1000, 7], (Kind::Float, Device::Cpu));
            let zeros = || Tensor::zeros([1000, 7], (Kind::Float, Device::Cpu));
            [p, g, zeros(), zeros()]
        };
        let fused = tensors();
        let mut ops: Vec<Tensor> = fused.iter().map(Tensor::copy).collect();
        let start = fused[0].copy();
        for step in 1..=5 {
            let (bc1, bc2) = (1.0 - f64::powi(beta1, step), 1.0 - f64::powi(0.999, step));
            let scalars = StepScalars {
                decay: 1.0 - 0.01 * wd,
                w1: 1.0 - beta1,
                beta2: 0.999,
                c2: 1.0 - 0.999,
                bc2_sqrt: bc2.sqrt(),
                eps: 1e-8,
                neg_step: -0.01 / bc1,
            };
            assert!(scalars.fused(&fused[0], &fused[1], &fused[2], &fused[3]));
            let [p, g, m, v] = &mut ops[..] else {
                unreachable!()
            };
            scalars.with_tensor_ops(p, g, m, v);
        }
        for (i, (a, b)) in fused.iter().zip(&ops).enumerate() {
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(
                diff < 1e-6,
                "beta1 {beta1}, wd {wd}: tensor {i} differs by {diff}"
            );
        }
        let moved = (&fused[0] - &start).abs().max().double_value(&[]);
        assert!(moved > 1e-3, "the parameter moved ({moved})");
    }
}

#[test]
fn weight_decay_is_decoupled() {
    // With zero gradients the Adam update is 0 / (0 + eps) = 0, so only the decoupled decay
    // acts: p *= 1 - lr * wd. (Coupled L2 decay would instead feed wd * p into the moments
    // and move every element by about lr.)
    let (lr, wd) = (0.1, 0.5);
    let p = param(&[2.0, -4.0, 8.0]);
    set_grad(&p, &[0.0, 0.0, 0.0]);
    let mut opt = AdamW::new(&[p.shallow_clone()], 0.9, 0.999, 1e-8, wd);
    opt.step(&[p.shallow_clone()], lr);
    assert_close(&values(&p), &[1.9, -3.8, 7.6], 1e-6);

    // And without weight decay nothing moves.
    let q = param(&[2.0, -4.0, 8.0]);
    set_grad(&q, &[0.0, 0.0, 0.0]);
    let mut opt = AdamW::new(&[q.shallow_clone()], 0.9, 0.999, 1e-8, 0.0);
    opt.step(&[q.shallow_clone()], lr);
    assert_close(&values(&q), &[2.0, -4.0, 8.0], 0.0);
}

#[test]
fn params_without_grad_are_skipped() {
    let a = param(&[1.0, 2.0]);
    let b = param(&[3.0, 4.0]);
    set_grad(&a, &[1.0, 1.0]);
    let params = [a.shallow_clone(), b.shallow_clone()];
    let mut opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.1);
    opt.step(&params, 0.1);
    assert!(!values(&a).iter().zip([1.0, 2.0]).any(|(x, y)| *x == y));
    assert_eq!(values(&b), vec![3.0, 4.0]);
}

fn make_params(seed: i64) -> Vec<Tensor> {
    tch::manual_seed(seed);
    vec![
        Tensor::randn([4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
        Tensor::randn([5], (Kind::Float, Device::Cpu)).set_requires_grad(true),
    ]
}

fn random_grads(params: &[Tensor]) {
    for p in params {
        let g = Tensor::randn(p.size(), (Kind::Float, Device::Cpu));
        let flat: Vec<f32> = Vec::try_from(&g.reshape([-1])).unwrap();
        set_grad(p, &flat);
    }
}

fn clone_params(params: &[Tensor]) -> Vec<Tensor> {
    params
        .iter()
        .map(|p| p.detach().copy().set_requires_grad(true))
        .collect()
}

#[test]
fn save_load_then_step_equals_continuing() {
    let params = make_params(7);
    let mut opt = AdamW::new(&params, 0.9, 0.95, 1e-8, 0.1);
    for step in 0..3 {
        random_grads(&params);
        opt.step(&params, 1e-2 / f64::from(step + 1));
    }
    let saved = opt.state_tensors();
    assert_eq!(saved.len(), 5);
    assert_eq!(saved[4].0, "step");
    assert_eq!(saved[4].1.kind(), Kind::Int64);
    assert_eq!(saved[4].1.size(), vec![1]);

    let resumed_params = clone_params(&params);
    let mut resumed = AdamW::new(&resumed_params, 0.9, 0.95, 1e-8, 0.1);
    resumed.load_state_tensors(&saved).unwrap();
    assert_eq!(resumed.steps_taken(), 3);

    // The snapshot is independent of later steps of the original.
    random_grads(&params);
    for (p, q) in params.iter().zip(&resumed_params) {
        let g = p.grad();
        set_grad(q, &Vec::<f32>::try_from(&g.reshape([-1])).unwrap());
    }
    opt.step(&params, 3e-3);
    resumed.step(&resumed_params, 3e-3);

    for (p, q) in params.iter().zip(&resumed_params) {
        assert!(p.equal(q));
    }
    for ((n1, t1), (n2, t2)) in opt.state_tensors().iter().zip(&resumed.state_tensors()) {
        assert_eq!(n1, n2);
        assert!(t1.equal(t2), "{n1} differs");
    }
    assert!(!saved[0].1.equal(&opt.state_tensors()[0].1));
}

#[test]
fn load_rejects_wrong_shape_naming_the_tensor() {
    let params = make_params(1);
    let opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
    let mut saved = opt.state_tensors();

    let other = [param(&[1.0, 2.0, 3.0]), param(&[0.0; 5])];
    let mut wrong = AdamW::new(&other, 0.9, 0.999, 1e-8, 0.0);
    let err = wrong.load_state_tensors(&saved).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("\"exp_avg.0\""), "{msg}");
    assert!(msg.contains("[4, 3]") && msg.contains("[3]"), "{msg}");
    assert!(!msg.contains('\n'));
    assert_eq!(wrong.steps_taken(), 0);

    // Missing, unexpected, duplicate and bad step are named too.
    let mut missing = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
    let without: Vec<(String, Tensor)> = saved
        .iter()
        .filter(|(n, _)| n != "exp_avg_sq.1")
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let msg = missing
        .load_state_tensors(&without)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("\"exp_avg_sq.1\""), "{msg}");

    let mut extra: Vec<(String, Tensor)> = saved
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    extra.push((
        "exp_avg.2".to_string(),
        Tensor::zeros([1], (Kind::Float, Device::Cpu)),
    ));
    let msg = missing.load_state_tensors(&extra).unwrap_err().to_string();
    assert!(
        msg.contains("unexpected") && msg.contains("\"exp_avg.2\""),
        "{msg}"
    );
    extra.pop();
    extra.push(("step".to_string(), Tensor::from_slice(&[1i64])));
    let msg = missing.load_state_tensors(&extra).unwrap_err().to_string();
    assert!(
        msg.contains("\"step\"") && msg.contains("more than once"),
        "{msg}"
    );

    let step = saved.iter().position(|(n, _)| n == "step").unwrap();
    saved[step].1 = Tensor::from_slice(&[-1i64]);
    let msg = missing.load_state_tensors(&saved).unwrap_err().to_string();
    assert!(msg.contains("\"step\""), "{msg}");
    saved[step].1 = Tensor::from_slice(&[1.0f32]);
    assert!(missing.load_state_tensors(&saved).is_err());
    assert_eq!(missing.steps_taken(), 0);
}

#[test]
fn load_rejects_wrong_dtype() {
    let params = make_params(2);
    let opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
    let mut saved = opt.state_tensors();
    saved[1].1 = saved[1].1.to_kind(Kind::Double);
    let mut fresh = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
    let msg = fresh.load_state_tensors(&saved).unwrap_err().to_string();
    assert!(
        msg.contains("\"exp_avg_sq.0\"") && msg.contains("Double"),
        "{msg}"
    );
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

#[test]
fn lr_schedule_values() {
    let (peak, min) = (1e-3, 1e-4);
    let sched = |schedule| LrSchedule {
        peak_lr: peak,
        warmup_steps: 10,
        total_steps: 110,
        schedule,
        min_lr: min,
    };
    for kind in [Schedule::Constant, Schedule::Linear, Schedule::Cosine] {
        let s = sched(kind);
        // Warm-up: peak / warmup at the start, peak at its last step and at its end.
        assert!(close(s.lr_at(0), peak / 10.0), "{kind:?}");
        assert!(close(s.lr_at(4), peak * 5.0 / 10.0), "{kind:?}");
        assert!(close(s.lr_at(9), peak), "{kind:?}");
        assert!(close(s.lr_at(10), peak), "{kind:?}");
    }
    let c = sched(Schedule::Constant);
    for step in [60, 110, 10_000] {
        assert!(close(c.lr_at(step), peak));
    }
    let l = sched(Schedule::Linear);
    assert!(close(l.lr_at(35), peak - 0.25 * (peak - min)));
    assert!(close(l.lr_at(60), (peak + min) / 2.0));
    assert!(close(l.lr_at(110), min));
    assert!(close(l.lr_at(10_000), min));
    let cos = sched(Schedule::Cosine);
    let quarter = min + 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()) * (peak - min);
    assert!(close(cos.lr_at(35), quarter));
    assert!(close(cos.lr_at(60), (peak + min) / 2.0));
    assert!(close(cos.lr_at(110), min));
    assert!(close(cos.lr_at(10_000), min));
    // Decreasing over the decay phase.
    for step in 10..110 {
        assert!(cos.lr_at(step + 1) <= cos.lr_at(step));
        assert!(l.lr_at(step + 1) <= l.lr_at(step));
    }
}

#[test]
fn lr_schedule_edge_cases() {
    let no_warmup = LrSchedule {
        peak_lr: 0.5,
        warmup_steps: 0,
        total_steps: 4,
        schedule: Schedule::Linear,
        min_lr: 0.1,
    };
    assert!(close(no_warmup.lr_at(0), 0.5));
    assert!(close(no_warmup.lr_at(2), 0.3));
    assert!(close(no_warmup.lr_at(4), 0.1));
    let total_within_warmup = LrSchedule {
        warmup_steps: 10,
        total_steps: 5,
        schedule: Schedule::Cosine,
        ..no_warmup
    };
    assert!(close(total_within_warmup.lr_at(9), 0.5));
    assert!(close(total_within_warmup.lr_at(10), 0.1));
    assert!(total_within_warmup.lr_at(10).is_finite());
}

/// Offloaded (moments on the host, values and gradients copied out and back; a tensor large
/// enough to be split over three threads) the steps give the plain optimizer's bits, and
/// either's state resumes the other.
#[test]
fn an_offloaded_optimizer_takes_the_same_steps_and_state() {
    tch::manual_seed(3);
    let big = (super::PARALLEL_ELEMENTS + 5) as i64;
    let make = || {
        vec![
            (Tensor::randn([big], (Kind::Float, Device::Cpu)) * 0.1).set_requires_grad(true),
            Tensor::randn([4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
        ]
    };
    let params = make();
    let copies = clone_params(&params);
    let mut plain = AdamW::new(&params, 0.9, 0.95, 1e-8, 0.1);
    let whole = vec![None; 2];
    let mut offloaded = AdamW::on_host(&copies, whole.clone(), 0.9, 0.95, 1e-8, 0.1);
    assert!(offloaded.offloaded() && !plain.offloaded());
    // The plain one on one thread, the offloaded one in three chunks; the process's count
    // restored whatever happens (other tests run beside this one).
    struct Threads(i32);
    impl Drop for Threads {
        fn drop(&mut self) {
            tch::set_num_threads(self.0);
        }
    }
    let _restore = Threads(tch::get_num_threads());
    for step in 0..3 {
        random_grads(&params);
        for (p, q) in params.iter().zip(&copies) {
            set_grad(q, &Vec::<f32>::try_from(&p.grad().reshape([-1])).unwrap());
        }
        tch::set_num_threads(1);
        plain.step(&params, 1e-2 / f64::from(step + 1));
        tch::set_num_threads(3);
        offloaded.step(&copies, 1e-2 / f64::from(step + 1));
        assert_eq!(plain.offload_bytes(), 0);
        assert_eq!(offloaded.offload_bytes(), 3 * 4 * (big as u64 + 12));
        for (p, q) in params.iter().zip(&copies) {
            assert!(p.equal(q), "step {step}");
        }
    }
    let state = offloaded.state_tensors();
    for ((n1, t1), (n2, t2)) in plain.state_tensors().iter().zip(&state) {
        assert_eq!(n1, n2);
        assert!(t1.equal(t2), "{n1} differs");
    }
    let mut resumed = AdamW::on_host(&clone_params(&copies), whole, 0.9, 0.95, 1e-8, 0.1);
    resumed.load_state_tensors(&plain.state_tensors()).unwrap();
    assert_eq!(resumed.steps_taken(), 3);
    for ((n1, t1), (n2, t2)) in resumed.state_tensors().iter().zip(&state) {
        assert_eq!(n1, n2);
        assert!(t1.equal(t2), "{n1} differs after the round trip");
    }
}
