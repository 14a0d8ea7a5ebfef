//! Anomaly mode with threads (its own test binary: the mode is process-wide, as PyTorch's
//! `set_detect_anomaly` is). A forward anomaly found on one thread is held for that thread:
//! another thread's ops, running at the same time, do not see it, and a DataParallel replica's
//! anomaly comes back from the forward that caused it, naming the op.

use std::sync::{Arc, Barrier};

use mixprec::distributed::{DataParallel, DataParallelConfig};
use mixprec::nn::{Linear, Module};
use mixprec::optim::{Sgd, SgdConfig};
use mixprec::{amp, DType, Device, Error, Tensor};

#[test]
fn a_held_anomaly_stays_with_its_thread_and_a_replicas_comes_back_from_forward() {
    mixprec::anomaly::detect(true);
    let b = Arc::new(Barrier::new(2));
    let b2 = b.clone();
    let bad = std::thread::spawn(move || {
        let x = Tensor::from_vec(vec![-1.0f32, 2.0], [2], Device::Cpu).unwrap();
        let _nan = x.log(); // held for this thread
        b2.wait(); // the other thread computes now
        b2.wait();
        let next = x.exp();
        assert!(matches!(next, Err(Error::NonFinite { .. })), "{next:?}");
    });
    b.wait();
    let y = Tensor::from_vec(vec![1.0f32, 2.0], [2], Device::Cpu).unwrap();
    let clean = y.exp().and_then(|t| t.sum_all());
    assert!(
        clean.is_ok(),
        "another thread's held anomaly leaked here: {clean:?}"
    );
    b.wait();
    bad.join().unwrap();

    let build = |d: Device| {
        let m = Linear::new(3, 2, true, &d, 1)?;
        let o = Sgd::new(m.parameters(), SgdConfig::default())?;
        Ok((m, o))
    };
    let policy = amp::Policy::opt_level(amp::OptLevel::O0).with_report_interval(0);
    let dp = DataParallel::new(
        build,
        &[Device::Cpu; 2],
        Device::Cpu,
        DataParallelConfig::new(policy),
    )
    .unwrap();
    let mut v = vec![0.5f32; 12];
    v[10] = f32::NAN; // row 3: replica 1's chunk
    let x = Tensor::from_vec(v, [4, 3], Device::Cpu).unwrap();
    let e = dp.forward(&x).unwrap_err();
    assert!(matches!(e, Error::NonFinite { .. }), "{e}");
    // This thread holds nothing, and the next clean forward runs.
    mixprec::anomaly::check().unwrap();
    let ok = Tensor::full([4, 3], 0.5, DType::F32, Device::Cpu).unwrap();
    dp.forward(&ok).unwrap();
    mixprec::anomaly::detect(false);
}
