//! Element types a buffer can hold.

use gradsync_core::DataType;

/// A plain-old-data element type that gradsync can reduce.
///
/// Implemented for `f32`, `f64`, `half::f16`, `half::bf16`, `i32`, `i64` and `u8`.
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {
    /// The matching [`DataType`].
    const DTYPE: DataType;
}

mod private {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}

element!(f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => Bf16, i32 => I32, i64 => I64, u8 => U8);
