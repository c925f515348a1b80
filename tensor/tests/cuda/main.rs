//! Device tensors against the host kernels, on a real GPU.
//!
//! Every test needs a CUDA GPU, so each is ignored in a plain `cargo test`;
//! `scripts/gpu-check.sh` runs them with `--ignored` on a GPU machine. Each
//! compares the device op with the same op on the host, on fresh random data.

use tessera_mesh::{ReduceOp, launch};
use tessera_tensor::cuda::{self, comm::DeviceCollectives};
use tessera_tensor::ops::Reduction;
use tessera_tensor::{DType, Device, Error, Tensor};

mod nn;
mod runtime;

const GPU: Device = Device::Cuda(0);
const NEEDS_GPU: &str = "needs a CUDA GPU";

fn rand(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, seed).unwrap().cast(dtype).unwrap()
}

fn gpu(t: &Tensor) -> Tensor {
    t.to(GPU).unwrap()
}

fn host(t: &Tensor) -> Tensor {
    assert_eq!(t.device(), GPU, "the op's result must stay on the GPU");
    t.to(Device::Cpu).unwrap()
}

/// ‖a − b‖ / ‖b‖ over f64 copies (0 for two zero tensors); NaN never passes.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    assert!(
        x.iter().all(|v| v.is_finite()) || x.iter().zip(&y).all(|(a, b)| a.is_nan() == b.is_nan()),
        "NaN in the device result"
    );
    let num: f64 = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f64 = y.iter().map(|b| b * b).sum();
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 { 1e-2 } else { 1e-6 }
}

fn check(what: &str, device: &Tensor, want: &Tensor, dtype: DType) {
    let e = rel_err(&host(device), want);
    println!("check {what:<40} {dtype:<5} rel_err {e:.2e}");
    assert!(
        e <= tol(dtype),
        "{what} ({dtype}): relative error {e:.3e} over {:.0e}",
        tol(dtype)
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trip_and_views() {
    let _ = NEEDS_GPU;
    assert!(cuda::is_available(), "no GPU: run this on a GPU machine");
    println!("device {}", cuda::device_name(0).unwrap());
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I64, DType::U8] {
        let t = Tensor::arange(24, dtype).unwrap().reshape(&[2, 3, 4]).unwrap();
        let d = gpu(&t);
        assert_eq!((d.device(), d.shape(), d.dtype()), (GPU, t.shape(), dtype));
        assert_eq!(host(&d), t, "{dtype} round trip");
        // Views stay on the device and copy through the strided kernel.
        let v = d.transpose(0, 2).unwrap().narrow(1, 1, 2).unwrap();
        assert_eq!(
            host(&v.contiguous()),
            t.transpose(0, 2).unwrap().narrow(1, 1, 2).unwrap().contiguous()
        );
        assert_eq!(
            host(&Tensor::cat(&[d.clone(), d.clone()], 1).unwrap()),
            Tensor::cat(&[t.clone(), t.clone()], 1).unwrap()
        );
    }
    // Host readers that cannot fail copy from the device; slices are refused.
    let d = gpu(&Tensor::arange(4, DType::F32).unwrap());
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
    assert!(matches!(d.as_slice::<f32>(), Err(Error::Device { .. })));
    let e = d.add(&Tensor::ones(&[4], DType::F32).unwrap()).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("cpu"), "{e}");
}

/// Copies of views whose rows are dense (heads of a `[batch, tokens, heads,
/// size]` tensor, in words of 16 bytes down to one element) and of views
/// whose rows are not, every dtype: equal to the host's bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_of_views() {
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I64, DType::U8] {
        for size in [64, 8, 6, 5, 3] {
            let t = Tensor::arange(2 * 7 * 3 * size, DType::I64)
                .unwrap()
                .cast(dtype)
                .unwrap()
                .reshape(&[2, 7, 3, size])
                .unwrap();
            let d = gpu(&t);
            let heads = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
            assert_eq!(
                host(&heads(&d).contiguous()),
                heads(&t).contiguous(),
                "{dtype} heads of {size}"
            );
            // Rows starting at odd elements: narrower words or the element kernel.
            let cut = |x: &Tensor| x.narrow(3, 1, size - 1).unwrap().permute(&[1, 0, 2, 3]).unwrap();
            assert_eq!(
                host(&cut(&d).contiguous()),
                cut(&t).contiguous(),
                "{dtype} cut rows of {size}"
            );
            let cols = |x: &Tensor| x.transpose(2, 3).unwrap();
            assert_eq!(
                host(&cols(&d).contiguous()),
                cols(&t).contiguous(),
                "{dtype} columns of {size}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn casts() {
    let x = rand(&[1000], DType::F32, 1).mul_scalar(100.0).unwrap();
    for (from, to) in [
        (DType::F32, DType::BF16),
        (DType::BF16, DType::F32),
        (DType::F64, DType::BF16),
        (DType::F32, DType::F64),
    ] {
        let src = x.cast(from).unwrap();
        assert_eq!(
            host(&gpu(&src).cast(to).unwrap()),
            src.cast(to).unwrap(),
            "{from} -> {to} bit for bit"
        );
        // Four elements per thread where both ends are aligned to four, one
        // otherwise: an odd length, and a view starting one element in.
        let view = gpu(&src).narrow(0, 1, 997).unwrap();
        assert_eq!(
            host(&view.cast(to).unwrap()),
            src.narrow(0, 1, 997).unwrap().cast(to).unwrap(),
            "{from} -> {to} of an unaligned view"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn element_wise_and_reductions() {
    for dtype in [DType::F32, DType::BF16] {
        let (a, b) = (rand(&[64, 257], dtype, 2), rand(&[257], dtype, 3));
        let (da, db) = (gpu(&a), gpu(&b));
        let pos = a.abs().unwrap().add_scalar(0.5).unwrap();
        let dpos = gpu(&pos);
        check("add (broadcast)", &da.add(&db).unwrap(), &a.add(&b).unwrap(), dtype);
        // A bias of a multiple of four elements is read four at a time, one
        // starting off the alignment one at a time.
        let (c, bias) = (rand(&[30, 256], dtype, 4), rand(&[257], dtype, 5));
        for start in [0, 1] {
            check(
                &format!("add (bias from element {start})"),
                &gpu(&c).add(&gpu(&bias).narrow(0, start, 256).unwrap()).unwrap(),
                &c.add(&bias.narrow(0, start, 256).unwrap()).unwrap(),
                dtype,
            );
        }
        check(
            "sub",
            &da.sub(&da.mul_scalar(0.3).unwrap()).unwrap(),
            &a.sub(&a.mul_scalar(0.3).unwrap()).unwrap(),
            dtype,
        );
        check(
            "mul (transposed view)",
            &da.transpose(0, 1)
                .unwrap()
                .mul(&db.reshape(&[257, 1]).unwrap())
                .unwrap(),
            &a.transpose(0, 1).unwrap().mul(&b.reshape(&[257, 1]).unwrap()).unwrap(),
            dtype,
        );
        check("div", &da.div(&dpos).unwrap(), &a.div(&pos).unwrap(), dtype);
        check("maximum", &da.maximum(&db).unwrap(), &a.maximum(&b).unwrap(), dtype);
        check("pow", &dpos.pow(1.7).unwrap(), &pos.pow(1.7).unwrap(), dtype);
        check("minimum", &da.minimum(&db).unwrap(), &a.minimum(&b).unwrap(), dtype);
        check(
            "clamp",
            &da.clamp(Some(-0.5), Some(0.5)).unwrap(),
            &a.clamp(Some(-0.5), Some(0.5)).unwrap(),
            dtype,
        );
        for (name, f) in [
            ("neg", Tensor::neg as fn(&Tensor) -> tessera_tensor::Result<Tensor>),
            ("exp", Tensor::exp),
            ("tanh", Tensor::tanh),
            ("gelu", Tensor::gelu),
            ("silu", Tensor::silu),
            ("relu", Tensor::relu),
            ("sigmoid", Tensor::sigmoid),
            ("square", Tensor::square),
        ] {
            check(name, &f(&da).unwrap(), &f(&a).unwrap(), dtype);
        }
        check("log", &dpos.log().unwrap(), &pos.log().unwrap(), dtype);
        check("rsqrt", &dpos.rsqrt().unwrap(), &pos.rsqrt().unwrap(), dtype);
        check(
            "gelu_backward",
            &da.gelu_backward(&gpu(&b.broadcast_to(&[64, 257]).unwrap().contiguous()))
                .unwrap(),
            &a.gelu_backward(&b.broadcast_to(&[64, 257]).unwrap().contiguous())
                .unwrap(),
            dtype,
        );
        // Column sums over leading dims: uneven column tiles and row counts.
        let big = rand(&[3, 1367, 333], dtype, 15);
        check(
            "sum dims 0,1 (columns)",
            &gpu(&big).sum(&[0, 1], false).unwrap(),
            &big.sum(&[0, 1], false).unwrap(),
            dtype,
        );
        check(
            "mean dim 0 keepdim (columns)",
            &gpu(&big).mean(&[0], true).unwrap(),
            &big.mean(&[0], true).unwrap(),
            dtype,
        );
        check(
            "sum dim 0",
            &da.sum(&[0], false).unwrap(),
            &a.sum(&[0], false).unwrap(),
            dtype,
        );
        check(
            "sum dim 1 keepdim",
            &da.sum(&[1], true).unwrap(),
            &a.sum(&[1], true).unwrap(),
            dtype,
        );
        check(
            "mean all",
            &da.mean(&[0, 1], false).unwrap(),
            &a.mean(&[0, 1], false).unwrap(),
            dtype,
        );
        check(
            "max dim 1",
            &da.max(&[1], false).unwrap(),
            &a.max(&[1], false).unwrap(),
            dtype,
        );
    }
}
