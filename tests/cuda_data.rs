//! GPU tests of the data path: pinned host buffers and their asynchronous uploads
//! (`backend::cuda::PinnedBuffer`), and a `DataLoader` delivering on the GPU, compared with the
//! same loader on the CPU. Ignored on CI (no GPU); run them on a GPU machine with
//! `scripts/gpu-stage` then `bash .gpu/run.sh cuda_data`.

use mixprec::backend::cpu::CpuStorage;
use mixprec::backend::cuda::{set_poison_allocations, PinnedBuffer};
use mixprec::data::{DataLoader, ImageFolder, ImageTransform, SyntheticDataset};
use mixprec::{DType, Device};

fn gpu() {
    set_poison_allocations(true);
    Device::cuda(0).expect("these tests need a CUDA GPU");
}

fn write_f32(buf: &PinnedBuffer, offset: usize, v: &[f32]) {
    assert!(offset + 4 * v.len() <= buf.len());
    // SAFETY: no upload is in flight (the caller waited) and the range is inside the buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(
            v.as_ptr(),
            buf.as_mut_ptr().add(offset) as *mut f32,
            v.len(),
        )
    }
}

fn tensor_of(storage: mixprec::backend::cuda::CudaStorage, n: usize) -> Vec<f32> {
    match storage.to_cpu().unwrap() {
        CpuStorage::F32(v) => {
            assert_eq!(v.len(), n);
            v
        }
        other => panic!("an F32 upload came back as {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pinned_uploads_are_ordered_and_reusable() {
    gpu();
    let n = 1 << 20;
    let buf = PinnedBuffer::new(0, 4 * n + 64).unwrap();
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    write_f32(&buf, 0, &a);
    let up_a = buf.upload(0, DType::F32, n).unwrap();
    // Reuse after the upload finished: the first copy keeps its data.
    buf.wait_uploads().unwrap();
    let b: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    write_f32(&buf, 0, &b);
    let up_b = buf.upload(0, DType::F32, n).unwrap();
    // An offset range.
    write_f32(&buf, 4 * n, &[1.5, 2.5]);
    buf.wait_uploads().unwrap();
    let up_c = buf.upload(4 * n, DType::F32, 2).unwrap();
    assert_eq!(tensor_of(up_a, n), a, "first upload");
    assert_eq!(tensor_of(up_b, n), b, "second upload");
    assert_eq!(tensor_of(up_c, 2), vec![1.5, 2.5]);
    // Out of range is an error, not a wild read.
    assert!(buf.upload(4 * n, DType::F32, 100).is_err());
}

fn batches(loader: &DataLoader, epoch: usize) -> Vec<(Vec<f32>, Vec<i64>, Device)> {
    loader
        .epoch(epoch)
        .map(|b| {
            let (x, y) = b.unwrap();
            let dev = x.device();
            assert_eq!(y.device(), dev);
            (x.to_vec::<f32>().unwrap(), y.to_vec::<i64>().unwrap(), dev)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_loader_delivers_what_the_cpu_loader_does() {
    gpu();
    let ds = SyntheticDataset::new(1000, [3, 17, 19], 7, 3).unwrap();
    for (workers, prefetch) in [(1, 1), (4, 2), (8, 3)] {
        let mk = |dev| {
            DataLoader::new(ds.clone(), 64)
                .unwrap()
                .shuffle(5)
                .workers(workers)
                .prefetch(prefetch)
                .device(dev)
        };
        let cpu = batches(&mk(Device::Cpu), 2);
        let gpu = batches(&mk(Device::Cuda(0)), 2);
        assert_eq!(cpu.len(), gpu.len());
        for ((xc, yc, dc), (xg, yg, dg)) in cpu.iter().zip(&gpu) {
            assert_eq!((*dc, *dg), (Device::Cpu, Device::Cuda(0)));
            assert_eq!(xc, xg, "workers {workers}");
            assert_eq!(yc, yg);
        }
    }
    // Many epochs with early drops: buffers are recycled and freed without errors.
    let l = DataLoader::new(ds, 16)
        .unwrap()
        .workers(4)
        .device(Device::Cuda(0));
    for e in 0..20 {
        let mut it = l.epoch(e);
        for _ in 0..(e % 5) {
            it.next().unwrap().unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_image_folder_batches_feed_a_model_step() {
    gpu();
    let root = std::env::temp_dir().join(format!("mixprec-cuda-data-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for i in 0..12 {
        let (w, h) = (80 + i, 64 + 2 * i);
        let px: Vec<u8> = (0..w * h * 3).map(|k| (k * 7 % 251) as u8).collect();
        let d = root.join(format!("c{}", i % 3));
        std::fs::create_dir_all(&d).unwrap();
        let mut bytes = Vec::new();
        jpeg_encoder::Encoder::new(&mut bytes, 90)
            .encode(&px, w as u16, h as u16, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        std::fs::write(d.join(format!("{i}.jpg")), bytes).unwrap();
    }
    let ds = ImageFolder::new(&root)
        .unwrap()
        .with_transform(ImageTransform::imagenet_train(32, 1))
        .unwrap();
    let ds = std::sync::Arc::new(ds);
    let mk = |dev| {
        DataLoader::from_arc(ds.clone(), 4)
            .unwrap()
            .shuffle(1)
            .workers(3)
            .device(dev)
    };
    let cpu = batches(&mk(Device::Cpu), 0);
    let gpu_b = batches(&mk(Device::Cuda(0)), 0);
    for ((xc, yc, _), (xg, yg, _)) in cpu.iter().zip(&gpu_b) {
        assert_eq!(xc, xg);
        assert_eq!(yc, yg);
    }
    // The delivered tensors are ordinary inputs of later ops on the device's stream.
    for b in mk(Device::Cuda(0)).epoch(1) {
        let (x, y) = b.unwrap();
        let s = x.sum_all().unwrap().to_vec::<f32>().unwrap()[0];
        assert!(s.is_finite());
        assert_eq!(y.dims(), &[4]);
    }
    let _ = std::fs::remove_dir_all(&root);
}
