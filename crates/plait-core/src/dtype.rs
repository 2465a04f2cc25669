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
    /// Every operator's name, in code order (`code() - 1`).
    pub const NAMES: [&'static str; 9] = ["sum", "avg", "prod", "min", "max", "band", "bor", "bxor", "premul_sum"];

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

    /// Parses an operator as users spell it, with premul_sum's factor (which no other op takes);
    /// the error says what is wrong in words a user can act on.
    pub fn parse(name: &str, factor: Option<f64>) -> Result<ReduceOp, String> {
        let op = ReduceOp::from_name(name, Some(factor.unwrap_or(1.0)))
            .ok_or_else(|| format!("unknown op {name:?} (expected one of {})", ReduceOp::NAMES.join(", ")))?;
        match (op, factor) {
            (ReduceOp::PremulSum(_), None) => Err("op 'premul_sum' needs factor=<number>".into()),
            (ReduceOp::PremulSum(_), Some(_)) | (_, None) => Ok(op),
            (_, Some(_)) => Err(format!("factor is only used with op 'premul_sum', not '{}'", op.name())),
        }
    }

    /// Why this operator cannot reduce `dtype`; None when it can.
    pub fn refusal(self, dtype: DType) -> Option<String> {
        match self {
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor if dtype.is_float() => {
                Some(format!("op '{}' is bitwise and not defined for floating dtype {dtype}", self.name()))
            }
            ReduceOp::Avg | ReduceOp::PremulSum(_) if !dtype.is_float() => {
                Some(format!("op '{}' is only defined for floating point dtypes, not {dtype}", self.name()))
            }
            _ => None,
        }
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

    /// Whether the operator is defined for `dtype` (see `refusal`).
    pub fn supports(self, dtype: DType) -> bool {
        self.refusal(dtype).is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_follow_their_codes_and_parse_back() {
        for (i, name) in ReduceOp::NAMES.iter().enumerate() {
            let op = ReduceOp::parse(name, (*name == "premul_sum").then_some(0.5)).unwrap();
            assert_eq!((op.name(), op.code() as usize), (*name, i + 1));
        }
    }

    #[test]
    fn misuse_of_an_op_is_explained() {
        assert!(ReduceOp::parse("median", None).unwrap_err().starts_with("unknown op \"median\""));
        assert!(ReduceOp::parse("premul_sum", None).unwrap_err().contains("needs factor"));
        assert!(ReduceOp::parse("sum", Some(2.0)).unwrap_err().contains("only used with op 'premul_sum'"));
        assert!(ReduceOp::BXor.refusal(DType::F32).unwrap().contains("bitwise"));
        assert!(ReduceOp::Avg.refusal(DType::I32).unwrap().contains("floating"));
        assert!(ReduceOp::Max.supports(DType::Bool) && ReduceOp::BAnd.supports(DType::Bool));
    }
}
