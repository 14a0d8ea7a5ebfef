//! Multi-tensor scale / zero / axpby / l2norm / unscale_l2norm fuzzed over sizes around the chunk size
//! (chunk−1, chunk, chunk+1, 1), 1 and 55 tensors, Inf/NaN planted at the first, middle and
//! last element of a list; per-tensor norms against an F64 reference; the loss-scale update rule;
//! dense views of one buffer as operands (DDP's bucket parts).

#[path = "fused_support/mod.rs"]
mod fused_support;

#[path = "fused_support/multi_tensor_cases.rs"]
mod multi_tensor_cases;

use mixprec::Device;

#[test]
fn scale_bitwise_and_overflow_flag() {
    multi_tensor_cases::scale_cases(Device::Cpu);
}

#[test]
fn zero_clears_every_listed_element() {
    multi_tensor_cases::zero_cases(Device::Cpu);
}

#[test]
fn axpby_and_its_checks() {
    multi_tensor_cases::axpby_cases(Device::Cpu);
}

#[test]
fn norms_global_and_per_tensor() {
    multi_tensor_cases::norm_cases(Device::Cpu);
}

#[test]
fn loss_scale_update_rule() {
    multi_tensor_cases::update_scale_cases(Device::Cpu);
}

#[test]
fn dense_views_of_one_buffer_are_operands() {
    multi_tensor_cases::view_cases(Device::Cpu);
}

#[test]
fn errors_name_the_op_and_the_operands() {
    multi_tensor_cases::error_cases(Device::Cpu);
}
