//! The element types and reduction operators plait understands.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum DType {
    F16 = 1,
    BF16 = 2,
    F32 = 3,
    F64 = 4,
    I8 = 5,
    U8 = 6,
    I16 = 7,
    I32 = 8,
    I64 = 9,
    Bool = 10,
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Bool,
    ];

    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        let n = name.to_ascii_lowercase();
        let d = match n.as_str() {
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i16" | "int16" => DType::I16,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "bool" => DType::Bool,
            _ => return None,
        };
        Some(d)
    }

    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as u8 == v)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operators. `Avg` and `PremulSum` reduce as `Sum` and scale the result once at the end
/// (`kernels::finalize`), so every rank applies the same single rounding.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Avg,
    Prod,
    Min,
    Max,
    BAnd,
    BOr,
    BXor,
    PremulSum(f64),
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::PremulSum(_) => "premul_sum",
        }
    }

    /// Parses `sum`, `avg`, ..., `premul_sum` (the factor is passed separately).
    pub fn from_name(name: &str, factor: Option<f64>) -> Option<ReduceOp> {
        let op = match name.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "band" => ReduceOp::BAnd,
            "bor" => ReduceOp::BOr,
            "bxor" => ReduceOp::BXor,
            "premul_sum" => ReduceOp::PremulSum(factor?),
            _ => return None,
        };
        Some(op)
    }

    /// Wire code, so that peers can check they agree on the operator.
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Prod => 3,
            ReduceOp::Min => 4,
            ReduceOp::Max => 5,
            ReduceOp::BAnd => 6,
            ReduceOp::BOr => 7,
            ReduceOp::BXor => 8,
            ReduceOp::PremulSum(_) => 9,
        }
    }

    /// The operator the pairwise kernels apply while data moves.
    pub fn combiner(self) -> ReduceOp {
        match self {
            ReduceOp::Avg | ReduceOp::PremulSum(_) => ReduceOp::Sum,
            other => other,
        }
    }

    /// Whether `op` is defined for `dtype` (bitwise ops only on integers and bool, avg and
    /// premul_sum only on floats).
    pub fn supports(self, dtype: DType) -> bool {
        match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
            ReduceOp::Avg | ReduceOp::PremulSum(_) => dtype.is_float(),
            _ => true,
        }
    }
}
