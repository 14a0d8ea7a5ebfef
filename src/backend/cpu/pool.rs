//! Pooling (placeholder signatures; implemented in the next commit).
use super::Elem;
use crate::backend::{AdaptivePoolParams, Pool2dParams};
pub fn max_pool2d<T: Elem>(_x: &[T], _p: &Pool2dParams) -> (Vec<T>, Vec<i64>) {
    todo!()
}
pub fn max_pool2d_backward<T: Elem>(_g: &[T], _idx: &[i64], _p: &Pool2dParams) -> Vec<T> {
    todo!()
}
pub fn avg_pool2d<T: Elem>(_x: &[T], _p: &Pool2dParams) -> Vec<T> {
    todo!()
}
pub fn avg_pool2d_backward<T: Elem>(_g: &[T], _p: &Pool2dParams) -> Vec<T> {
    todo!()
}
pub fn adaptive_avg_pool2d<T: Elem>(_x: &[T], _p: &AdaptivePoolParams) -> Vec<T> {
    todo!()
}
pub fn adaptive_avg_pool2d_backward<T: Elem>(_g: &[T], _p: &AdaptivePoolParams) -> Vec<T> {
    todo!()
}
