//! Batch norm (placeholder signatures; implemented in the next commit).
use super::Elem;
use crate::backend::BatchNormParams;
pub fn forward_train<T: Elem>(
    _x: &[T],
    _w: &[T::Acc],
    _b: &[T::Acc],
    _rm: &mut [T::Acc],
    _rv: &mut [T::Acc],
    _p: &BatchNormParams,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    todo!()
}
pub fn backward<T: Elem>(
    _g: &[T],
    _x: &[T],
    _w: &[T::Acc],
    _mean: &[T::Acc],
    _invstd: &[T::Acc],
    _p: &BatchNormParams,
) -> (Vec<T>, Vec<T::Acc>, Vec<T::Acc>) {
    todo!()
}
