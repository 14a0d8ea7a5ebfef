//! The traced graph of a fused function: primitive nodes over one iteration domain, each with
//! the dtype the unfused chain would give it and the set of domain dims it varies along.
//!
//! Shapes are symbolic. A graph is traced for a [`Signature`] (each input's dtype, rank and which
//! of its dims are broadcast, size 1); the sizes come with each call. Every value lives in the
//! domain of rank `R` (the inputs' largest rank; lower-rank inputs are aligned to its last dims,
//! as broadcasting does) and is described by its [`Dims`]: the domain dims it varies along. A
//! value is broadcast along the others, and a reduction removes its reduced dims from the set
//! (they stay in its shape as size 1: reductions keep their dims, PyTorch's `keepdim=true`).

use crate::base::DType;

/// The most dims a fused function's domain may have.
pub const MAX_RANK: usize = 8;

/// A set of domain dims (bit `d`: dim `d`), the dims a value varies along.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dims(pub u8);

impl Dims {
    pub fn has(self, d: usize) -> bool {
        self.0 & (1 << d) != 0
    }
    pub fn union(self, o: Dims) -> Dims {
        Dims(self.0 | o.0)
    }
    pub fn minus(self, o: Dims) -> Dims {
        Dims(self.0 & !o.0)
    }
    pub fn contains(self, o: Dims) -> bool {
        self.0 & o.0 == o.0
    }
    /// The dims of the last `rank` of a rank-`r` domain.
    pub fn last(rank: usize, r: usize) -> Dims {
        let mut m = 0u8;
        for d in r - rank..r {
            m |= 1 << d;
        }
        Dims(m)
    }
    /// Elements of a value varying along these dims, in a domain of `sizes`.
    pub fn count(self, sizes: &[usize]) -> usize {
        (0..sizes.len())
            .filter(|&d| self.has(d))
            .map(|d| sizes[d])
            .product()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryFn {
    Neg,
    Exp,
    Log,
    Tanh,
    Erf,
    Sqrt,
    Rsqrt,
    Abs,
    Relu,
    Sigmoid,
    Recip,
    Sin,
    Cos,
}

impl UnaryFn {
    pub fn name(self) -> &'static str {
        match self {
            UnaryFn::Neg => "neg",
            UnaryFn::Exp => "exp",
            UnaryFn::Log => "log",
            UnaryFn::Tanh => "tanh",
            UnaryFn::Erf => "erf",
            UnaryFn::Sqrt => "sqrt",
            UnaryFn::Rsqrt => "rsqrt",
            UnaryFn::Abs => "abs",
            UnaryFn::Relu => "relu",
            UnaryFn::Sigmoid => "sigmoid",
            UnaryFn::Recip => "recip",
            UnaryFn::Sin => "sin",
            UnaryFn::Cos => "cos",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryFn {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl BinaryFn {
    /// Comparisons give 1 or 0 (in the operands' promoted float dtype).
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryFn::Lt | BinaryFn::Le | BinaryFn::Gt | BinaryFn::Ge | BinaryFn::Eq | BinaryFn::Ne
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceFn {
    Sum,
    Max,
    Min,
}

/// A value of the graph: an index into [`Graph::items`].
pub type Value = usize;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Node {
    /// The function's `i`-th input.
    Input(usize),
    Const(f64),
    /// How many elements the domain has along these dims (a mean's divisor): symbolic.
    Size(Dims),
    Unary(UnaryFn, Value),
    Binary(BinaryFn, Value, Value),
    /// `x^e`, a scalar exponent.
    Pow(Value, f64),
    /// `c != 0 ? a : b`.
    Select(Value, Value, Value),
    /// The operand in this item's dtype (rounded to it when that is narrower).
    Cast(Value),
    /// The operand made to vary along this item's dims (an identity on values).
    Broadcast(Value),
    /// A reduction over the operand's dims that this item lacks.
    Reduce(ReduceFn, Value),
}

impl Node {
    pub fn operands(&self) -> Vec<Value> {
        match *self {
            Node::Input(_) | Node::Const(_) | Node::Size(_) => vec![],
            Node::Unary(_, a)
            | Node::Pow(a, _)
            | Node::Cast(a)
            | Node::Broadcast(a)
            | Node::Reduce(_, a) => vec![a],
            Node::Binary(_, a, b) => vec![a, b],
            Node::Select(c, a, b) => vec![c, a, b],
        }
    }
}

/// One node with what is known of its value at trace time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Item {
    pub node: Node,
    /// The dtype the unfused chain would give this value (what an output is stored as).
    /// Arithmetic is in f64 for f64 values, else in f32.
    pub dtype: DType,
    /// A scalar constant's dtype gives way to the other operand's (as a Rust/Python scalar).
    pub weak: bool,
    pub dims: Dims,
    /// The value's rank: its shape is the domain's last `rank` dims, size 1 outside `dims`.
    pub rank: usize,
}

impl Item {
    /// Whether this value is computed in f64 (else f32).
    pub fn wide(&self) -> bool {
        self.dtype == DType::F64
    }
}

/// What a graph is traced for: one entry per input.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputSig {
    pub dtype: DType,
    pub rank: usize,
    /// The domain dims the input varies along (its dims of size other than 1).
    pub dims: Dims,
}

/// The key of a traced graph: the inputs' signatures, the domain's rank and the autocast
/// state the trace ran under (its casts are part of the graph).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    pub inputs: Vec<InputSig>,
    pub rank: usize,
    pub autocast: Option<DType>,
}

/// A traced function: its items in an order where operands come first, and its outputs.
#[derive(Clone, Debug)]
pub struct Graph {
    pub name: &'static str,
    pub sig: Signature,
    pub items: Vec<Item>,
    pub outputs: Vec<Value>,
}

impl Graph {
    /// The items the outputs depend on, each marked.
    pub fn live(&self) -> Vec<bool> {
        self.live_for(&self.outputs)
    }

    /// The items `outputs` depend on, each marked.
    pub fn live_for(&self, outputs: &[Value]) -> Vec<bool> {
        let mut live = vec![false; self.items.len()];
        for &o in outputs {
            live[o] = true;
        }
        for v in (0..self.items.len()).rev() {
            if live[v] {
                for o in self.items[v].node.operands() {
                    live[o] = true;
                }
            }
        }
        live
    }

    /// How many reductions (live) the graph has.
    pub fn reductions(&self) -> usize {
        let live = self.live();
        self.items
            .iter()
            .enumerate()
            .filter(|(v, it)| live[*v] && matches!(it.node, Node::Reduce(..)))
            .count()
    }

    /// An output's shape for a domain of `sizes`.
    pub fn shape_of(&self, v: Value, sizes: &[usize]) -> Vec<usize> {
        let it = &self.items[v];
        let r = sizes.len();
        (r - it.rank..r)
            .map(|d| if it.dims.has(d) { sizes[d] } else { 1 })
            .collect()
    }
}
