//! 2-D convolution (placeholder signatures; implemented in the next commit).
use super::Elem;
use crate::backend::Conv2dParams;
pub fn conv2d<T: Elem>(_x: &[T], _w: &[T], _p: &Conv2dParams) -> Vec<T> {
    todo!()
}
pub fn conv2d_backward_input<T: Elem>(_g: &[T], _w: &[T], _p: &Conv2dParams) -> Vec<T> {
    todo!()
}
pub fn conv2d_backward_weight<T: Elem>(_g: &[T], _x: &[T], _p: &Conv2dParams) -> Vec<T> {
    todo!()
}
