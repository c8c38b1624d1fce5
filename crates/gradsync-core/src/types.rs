//! Element types, reduction operators and collective kinds.

use std::fmt;

/// Errors of parsing a name or a wire code into one of this module's types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TypeError {
    /// The data type name or code is unknown.
    #[error(
        "unknown data type {0:?} (expected one of float, double, half, bfloat16, int32, int64, uint8)"
    )]
    UnknownDataType(String),
    /// The reduction operator name or code is unknown.
    #[error(
        "unknown reduction op {0:?} (expected one of sum, prod, min, max, avg, band, bor, bxor)"
    )]
    UnknownOp(String),
    /// A bitwise operator was asked of a floating-point type: bitwise reductions are defined
    /// for the integer types only.
    #[error(
        "reduction op {op} is bitwise and is not defined for the floating-point type {dtype} \
         (bitwise ops take int32, int64 or uint8)"
    )]
    OpNotForType {
        /// The operator.
        op: ReduceOp,
        /// The element type.
        dtype: DataType,
    },
    /// The collective code is unknown.
    #[error("unknown collective code {0}")]
    UnknownCollective(u8),
}

/// Element type of a buffer.
///
/// `F16` and `Bf16` are reduced through `f32` (each element widened, combined, rounded back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// IEEE 754 binary32 (`float`).
    F32 = 0,
    /// IEEE 754 binary64 (`double`).
    F64 = 1,
    /// IEEE 754 binary16 (`half`).
    F16 = 2,
    /// bfloat16 (`bfloat16`).
    Bf16 = 3,
    /// Signed 32-bit integer (`int32`).
    I32 = 4,
    /// Signed 64-bit integer (`int64`).
    I64 = 5,
    /// Unsigned 8-bit integer (`uint8`).
    U8 = 6,
}

impl DataType {
    /// Every data type, in code order.
    pub const ALL: [DataType; 7] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::Bf16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 => 4,
            DataType::F64 | DataType::I64 => 8,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::U8 => 1,
        }
    }

    /// The name nccl-tests uses for this type (`float`, `double`, `half`, `bfloat16`, `int32`,
    /// `int64`, `uint8`).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::U8 => "uint8",
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F64 | DataType::F16 | DataType::Bf16
        )
    }

    /// Parses a name: the nccl-tests names and the usual aliases (`f32`, `fp16`, `bf16`, ...).
    pub fn parse(s: &str) -> Result<Self, TypeError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "float" | "f32" | "float32" | "fp32" => DataType::F32,
            "double" | "f64" | "float64" | "fp64" => DataType::F64,
            "half" | "f16" | "float16" | "fp16" => DataType::F16,
            "bfloat16" | "bf16" => DataType::Bf16,
            "int32" | "i32" | "int" => DataType::I32,
            "int64" | "i64" => DataType::I64,
            "uint8" | "u8" => DataType::U8,
            _ => return Err(TypeError::UnknownDataType(s.to_string())),
        })
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Result<Self, TypeError> {
        DataType::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| TypeError::UnknownDataType(format!("code {code}")))
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator.
///
/// `Sum`, `Prod`, `Min`, `Max` and `Avg` apply to every [`DataType`]. `Avg` sums and divides the
/// sum by the world size once, on the rank that owns each slice, so every rank ends with the same
/// bits (integer types divide with truncation).
///
/// `Band`, `Bor` and `Bxor` are the bitwise and, or and exclusive or of the integer types
/// (`int32`, `int64`, `uint8`), torch's `BAND`, `BOR` and `BXOR`. Like integer min and max they
/// are exact, associative and commutative, so their result does not depend on the algorithm. They
/// are not defined for floating-point types: a call that asks for one over a float buffer fails
/// before anything is sent ([`ReduceOp::check`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum.
    Sum = 0,
    /// Product.
    Prod = 1,
    /// Minimum (NaN wins for floats).
    Min = 2,
    /// Maximum (NaN wins for floats).
    Max = 3,
    /// Mean: sum divided by the number of ranks.
    Avg = 4,
    /// Bitwise and (integer types only).
    Band = 5,
    /// Bitwise or (integer types only).
    Bor = 6,
    /// Bitwise exclusive or (integer types only).
    Bxor = 7,
}

impl ReduceOp {
    /// Every operator, in code order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ];

    /// The name nccl-tests uses (`sum`, `prod`, `min`, `max`, `avg`), and `band`, `bor`, `bxor`
    /// for the bitwise operators (torch's names, lowercase).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
        }
    }

    /// Whether this is a bitwise operator (`Band`, `Bor`, `Bxor`), defined for integer types only.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor)
    }

    /// Whether this operator is defined for `dtype`: every operator is, except the bitwise ones
    /// for floating-point types.
    pub const fn supports(self, dtype: DataType) -> bool {
        !(self.is_bitwise() && dtype.is_float())
    }

    /// [`ReduceOp::supports`] as a result: [`TypeError::OpNotForType`] for a bitwise operator
    /// over a floating-point type.
    pub fn check(self, dtype: DataType) -> Result<(), TypeError> {
        if self.supports(dtype) {
            Ok(())
        } else {
            Err(TypeError::OpNotForType { op: self, dtype })
        }
    }

    /// Parses a name, case-insensitively: `sum`, `prod` (or `product`), `min`, `max`, `avg` (or
    /// `mean`), `band`, `bor`, `bxor`.
    pub fn parse(s: &str) -> Result<Self, TypeError> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "prod" | "product" => ReduceOp::Prod,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            "avg" | "mean" => ReduceOp::Avg,
            "band" => ReduceOp::Band,
            "bor" => ReduceOp::Bor,
            "bxor" => ReduceOp::Bxor,
            _ => return Err(TypeError::UnknownOp(s.to_string())),
        })
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Result<Self, TypeError> {
        ReduceOp::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| TypeError::UnknownOp(format!("code {code}")))
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Kind of collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Collective {
    /// Every rank ends with the reduction of all inputs.
    AllReduce = 0,
    /// Rank r ends with slice r of the reduction.
    ReduceScatter = 1,
    /// Every rank ends with the concatenation of all inputs.
    AllGather = 2,
    /// Every rank ends with the root's buffer.
    Broadcast = 3,
    /// The root ends with the reduction of all inputs.
    Reduce = 4,
    /// No rank leaves before every rank has entered.
    Barrier = 5,
    /// Point-to-point message (send side and receive side share this kind).
    SendRecv = 6,
    /// Rank r sends block p of its input to rank p, which stores it as block r of its output;
    /// every block has the same size.
    AllToAll = 7,
    /// All-to-all with a count per pair of ranks (`all_to_allv`): the signature's count is 0,
    /// and each message's length is checked against what its receiver expects.
    AllToAllV = 8,
    /// The root ends with the concatenation of all inputs (rank r's at block r).
    Gather = 9,
    /// Rank r ends with block r of the root's input.
    Scatter = 10,
}

impl Collective {
    /// Every kind, in code order.
    pub const ALL: [Collective; 11] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Barrier,
        Collective::SendRecv,
        Collective::AllToAll,
        Collective::AllToAllV,
        Collective::Gather,
        Collective::Scatter,
    ];

    /// Name in snake case (`all_reduce`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Barrier => "barrier",
            Collective::SendRecv => "send_recv",
            Collective::AllToAll => "all_to_all",
            Collective::AllToAllV => "all_to_allv",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
        }
    }

    /// Whether the collective only moves data: no rank reduces anything it receives.
    pub const fn moves_only(self) -> bool {
        matches!(
            self,
            Collective::AllGather
                | Collective::Broadcast
                | Collective::SendRecv
                | Collective::AllToAll
                | Collective::AllToAllV
                | Collective::Gather
                | Collective::Scatter
        )
    }

    /// Decodes a wire code.
    pub fn from_code(code: u8) -> Result<Self, TypeError> {
        Collective::ALL
            .get(code as usize)
            .copied()
            .ok_or(TypeError::UnknownCollective(code))
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_parse_back_and_codes_follow_all() {
        for (code, op) in ReduceOp::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, code);
            assert_eq!(ReduceOp::from_code(code as u8), Ok(op));
            assert_eq!(ReduceOp::parse(op.name()), Ok(op));
            assert_eq!(ReduceOp::parse(&op.name().to_uppercase()), Ok(op));
        }
        assert!(ReduceOp::from_code(ReduceOp::ALL.len() as u8).is_err());
        let e = ReduceOp::parse("nand").unwrap_err().to_string();
        assert!(e.contains("band, bor, bxor"), "{e}");
    }

    #[test]
    fn bitwise_ops_take_integer_types_only() {
        let bitwise = [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor];
        for op in ReduceOp::ALL {
            assert_eq!(op.is_bitwise(), bitwise.contains(&op), "{op}");
            for dtype in DataType::ALL {
                let ok = !(op.is_bitwise() && dtype.is_float());
                assert_eq!(op.supports(dtype), ok, "{op} {dtype}");
                assert_eq!(op.check(dtype).is_ok(), ok, "{op} {dtype}");
            }
        }
        let e = ReduceOp::Bxor.check(DataType::F32).unwrap_err();
        assert_eq!(
            e,
            TypeError::OpNotForType {
                op: ReduceOp::Bxor,
                dtype: DataType::F32
            }
        );
        assert_eq!(
            e.to_string(),
            "reduction op bxor is bitwise and is not defined for the floating-point type float \
             (bitwise ops take int32, int64 or uint8)"
        );
    }
}
