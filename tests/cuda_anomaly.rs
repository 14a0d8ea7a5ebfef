//! Anomaly mode and the eval batch norm on a GPU: the planted NaN is named as on the CPU (the
//! check reads each output through one flag reduction), a capture with the mode on fails
//! saying why, and the eval batch norm (f32 math, one rounding) equals the CPU's.

use mixprec::anomaly::{self, Phase};
use mixprec::{BatchNormConfig, DType, Device, Error, MemoryFormat, Result, Tensor};

fn gpu() -> Device {
    Device::cuda(0).expect("this test needs a CUDA GPU")
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn anomaly_on_the_gpu_names_the_op_and_refuses_a_capture() -> Result<()> {
    let dev = gpu();
    let _on = anomaly::detect_scope(true);
    anomaly::clear();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::from_vec(vec![1.0f32, -1.0, 2.0], vec![3], Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let y = x.log()?;
        let e = y.sum_all().expect_err("the NaN of log(-1)");
        assert!(matches!(e, Error::NonFinite { .. }), "{e}");
        let r = anomaly::last_report().expect("a report");
        assert_eq!(
            (r.phase, r.op, r.nan, r.dtype),
            (Phase::Forward, "log", 1, dtype)
        );
        // Finite outputs pass.
        x.abs()?.sqrt()?.sum_all()?;
        anomaly::check()?;
    }
    let x = Tensor::ones([4], DType::F32, dev)?;
    // The op once outside the capture (its kernel loaded), so what the capture refuses is the
    // anomaly mode, not a first use.
    x.mul_scalar(2.0)?;
    let r = mixprec::graph::capture(dev, || {
        let _ = x.mul_scalar(2.0)?;
        anomaly::check()
    });
    let Err(e) = r else {
        panic!("a capture with anomaly mode on fails");
    };
    assert!(e.to_string().contains("anomaly mode"), "{e}");
    anomaly::clear();
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn eval_batch_norm_matches_the_cpu() -> Result<()> {
    let dev = gpu();
    let cfg = BatchNormConfig {
        training: false,
        ..Default::default()
    };
    let dims = vec![4, 8, 6, 6];
    let x = Tensor::rand_uniform(dims.clone(), -4.0, 4.0, 1, DType::F16, Device::Cpu)?;
    let r = Tensor::rand_uniform(dims, -2.0, 2.0, 2, DType::F16, Device::Cpu)?;
    let v = |lo, hi, s| Tensor::rand_uniform(vec![8], lo, hi, s, DType::F32, Device::Cpu);
    let (w, b, m, var) = (
        v(0.5, 1.5, 3)?,
        v(-2.0, 2.0, 4)?,
        v(-3.0, 3.0, 5)?,
        v(0.3, 2.5, 6)?,
    );
    let want = x
        .batch_norm_add_relu(&r, &w, &b, &m, &var, cfg)?
        .to_vec_f64()?;
    let on = |t: &Tensor| t.to_device(dev);
    for format in [MemoryFormat::Contiguous, MemoryFormat::ChannelsLast] {
        let xg = on(&x)?.to_memory_format(format)?;
        let rg = on(&r)?.to_memory_format(format)?;
        let got = xg
            .batch_norm_add_relu(&rg, &on(&w)?, &on(&b)?, &on(&m)?, &on(&var)?, cfg)?
            .to_vec_f64()?;
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / w.abs().max(1e-3))
            .fold(0.0, f64::max);
        // f32 math on both, rounded once to f16: equal but for rare ties of the last f32 bit.
        assert!(
            worst <= 1e-3,
            "{format:?}: worst relative difference {worst}"
        );
    }
    Ok(())
}
