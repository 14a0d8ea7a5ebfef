//! A chain of modules applied in order; children are named `0`, `1`, ... (PyTorch's
//! `nn.Sequential`).

use super::module::{Module, TrainingFlag};
use crate::error::Result;
use crate::tensor::Tensor;

#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
    training: TrainingFlag,
}

impl std::fmt::Debug for Sequential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequential[{} layers]", self.layers.len())
    }
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends a layer (builder style).
    pub fn with<M: Module + 'static>(mut self, layer: M) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }

    pub fn push(&mut self, layer: Box<dyn Module>) {
        self.layers.push(layer);
    }

    pub fn len(&self) -> usize {
        self.layers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&dyn Module> {
        self.layers.get(i).map(|b| &**b)
    }

    pub fn iter(&self) -> impl Iterator<Item = &dyn Module> {
        self.layers.iter().map(|b| &**b)
    }
}

impl FromIterator<Box<dyn Module>> for Sequential {
    fn from_iter<I: IntoIterator<Item = Box<dyn Module>>>(iter: I) -> Self {
        Sequential {
            layers: iter.into_iter().collect(),
            training: TrainingFlag::default(),
        }
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            let _scope = crate::anomaly::module_index(i);
            y = l.forward(&y)?;
        }
        Ok(y)
    }

    fn visit_children(&self, f: &mut dyn FnMut(&str, &dyn Module)) {
        for (i, l) in self.layers.iter().enumerate() {
            f(&i.to_string(), &**l);
        }
    }

    fn training_flag(&self) -> Option<&TrainingFlag> {
        Some(&self.training)
    }
}
