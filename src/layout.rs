//! What one KV chunk looks like: element type, memory format and shape.
//! The bottom of the crate: `config` and `memory` both build on these values.
//!
//! A page of a pool holds exactly one full chunk; a partial chunk (only the
//! last chunk of a request may be one) occupies a prefix of its page.

use std::fmt;
use std::str::FromStr;

pub mod tp;

/// Element type of a KV chunk, named as torch names them on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `bfloat16` (2 bytes).
    BFloat16,
    /// `float16` / `half` (2 bytes).
    Float16,
    /// `float32` / `float` (4 bytes).
    Float32,
    /// `int8` (1 byte), quantised caches.
    Int8,
    /// `uint8` (1 byte), quantised caches.
    UInt8,
}

impl Dtype {
    /// Every dtype, in the order error messages list them.
    pub const ALL: [Dtype; 5] = [
        Dtype::BFloat16,
        Dtype::Float16,
        Dtype::Float32,
        Dtype::Int8,
        Dtype::UInt8,
    ];

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            Dtype::BFloat16 | Dtype::Float16 => 2,
            Dtype::Float32 => 4,
            Dtype::Int8 | Dtype::UInt8 => 1,
        }
    }

    /// The canonical wire name (`"bfloat16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BFloat16 => "bfloat16",
            Dtype::Float16 => "float16",
            Dtype::Float32 => "float32",
            Dtype::Int8 => "int8",
            Dtype::UInt8 => "uint8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype string that names no dtype we know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype {0:?} (expected one of bfloat16, float16, float32, int8, uint8)")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;

    /// Accepts the canonical names, torch's `torch.` prefix and the usual aliases.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bare = s.strip_prefix("torch.").unwrap_or(s);
        Ok(match bare {
            "bfloat16" | "bf16" => Dtype::BFloat16,
            "float16" | "half" | "fp16" => Dtype::Float16,
            "float32" | "float" | "fp32" => Dtype::Float32,
            "int8" => Dtype::Int8,
            "uint8" => Dtype::UInt8,
            _ => return Err(UnknownDtype(s.to_string())),
        })
    }
}

/// Memory format of a chunk, with LMCache's numeric codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemFormat {
    /// `KV_2LTD` (code 1): `[2, layers, tokens, hidden]`, K and V stacked.
    Kv2Ltd,
    /// `KV_MLA_FMT` (code 6): `[1, layers, tokens, hidden]`, one latent tensor.
    Mla,
}

impl MemFormat {
    /// The code carried in the `fmt` field of the wire messages.
    pub fn code(self) -> i64 {
        match self {
            MemFormat::Kv2Ltd => 1,
            MemFormat::Mla => 6,
        }
    }

    /// The format for a wire code, if it is one we can move.
    pub fn from_code(code: i64) -> Option<MemFormat> {
        match code {
            1 => Some(MemFormat::Kv2Ltd),
            6 => Some(MemFormat::Mla),
            _ => None,
        }
    }

    /// Size of the leading K/V dimension: 2 for `KV_2LTD`, 1 for MLA.
    pub fn kv_planes(self) -> usize {
        match self {
            MemFormat::Kv2Ltd => 2,
            MemFormat::Mla => 1,
        }
    }

    /// Index of the token dimension in the chunk shape.
    pub const TOKEN_DIM: usize = 2;
}

/// The geometry of one chunk: everything needed to size a page and to
/// describe a (possibly partial) chunk on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkLayout {
    /// Memory format.
    pub fmt: MemFormat,
    /// Transformer layers.
    pub layers: usize,
    /// Tokens in a full chunk (`chunk_size`).
    pub tokens: usize,
    /// Elements per token per layer per plane (kv heads × head size, or the MLA latent size).
    pub hidden: usize,
    /// Element type.
    pub dtype: Dtype,
}

impl ChunkLayout {
    /// Wire shape of a chunk holding `tokens` tokens.
    pub fn shape_for(&self, tokens: usize) -> [usize; 4] {
        [self.fmt.kv_planes(), self.layers, tokens, self.hidden]
    }

    /// Wire shape of a full chunk.
    pub fn full_shape(&self) -> [usize; 4] {
        self.shape_for(self.tokens)
    }

    /// Bytes of a chunk holding `tokens` tokens (a partial chunk is a prefix of its page).
    pub fn bytes_for(&self, tokens: usize) -> usize {
        self.shape_for(tokens).iter().product::<usize>() * self.dtype.size()
    }

    /// Bytes of one full chunk: the page size of every pool.
    pub fn page_bytes(&self) -> usize {
        self.bytes_for(self.tokens)
    }

    /// Recovers a layout from a wire description (`fmt`, `shape`, `dtype`),
    /// checking that the shape has the format's rank and plane count.
    pub fn from_wire(fmt: i64, shape: &[u64], dtype: &str) -> Result<ChunkLayout, String> {
        let fmt = MemFormat::from_code(fmt)
            .ok_or_else(|| format!("unsupported fmt {fmt} (expected 1 = KV_2LTD or 6 = MLA)"))?;
        let dtype: Dtype = dtype.parse().map_err(|e: UnknownDtype| e.to_string())?;
        if shape.len() != 4 {
            return Err(format!(
                "shape {shape:?} has {} dims, expected 4",
                shape.len()
            ));
        }
        let dims: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| format!("shape dim {d} too large")))
            .collect::<Result<_, _>>()?;
        if dims[0] != fmt.kv_planes() {
            return Err(format!(
                "shape {shape:?} has {} planes, fmt {} needs {}",
                dims[0],
                fmt.code(),
                fmt.kv_planes()
            ));
        }
        if dims[1] == 0 || dims[2] == 0 || dims[3] == 0 {
            return Err(format!("shape {shape:?} has a zero dimension"));
        }
        let layout = ChunkLayout {
            fmt,
            layers: dims[1],
            tokens: dims[2],
            hidden: dims[3],
            dtype,
        };
        dims.iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("shape {shape:?} overflows a byte count"))?;
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_round_trip_and_aliases_parse() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
        }
        assert_eq!("torch.bfloat16".parse::<Dtype>().unwrap(), Dtype::BFloat16);
        assert_eq!("half".parse::<Dtype>().unwrap(), Dtype::Float16);
        let err = "complex64".parse::<Dtype>().unwrap_err().to_string();
        assert!(
            err.contains("complex64") && err.contains("bfloat16"),
            "{err}"
        );
    }

    #[test]
    fn page_bytes_is_product_of_shape_and_partial_is_prefix() {
        let l = ChunkLayout {
            fmt: MemFormat::Kv2Ltd,
            layers: 36,
            tokens: 256,
            hidden: 1024,
            dtype: Dtype::BFloat16,
        };
        assert_eq!(l.full_shape(), [2, 36, 256, 1024]);
        assert_eq!(l.page_bytes(), 2 * 36 * 256 * 1024 * 2);
        assert_eq!(l.bytes_for(77), 2 * 36 * 77 * 1024 * 2);
        let mla = ChunkLayout {
            fmt: MemFormat::Mla,
            ..l
        };
        assert_eq!(mla.full_shape()[0], 1);
        assert_eq!(mla.page_bytes(), l.page_bytes() / 2);
    }

    #[test]
    fn from_wire_checks_rank_planes_and_codes() {
        let l = ChunkLayout::from_wire(1, &[2, 36, 256, 1024], "bfloat16").unwrap();
        assert_eq!(l.tokens, 256);
        assert!(ChunkLayout::from_wire(3, &[2, 36, 256, 1024], "bfloat16")
            .unwrap_err()
            .contains("fmt 3"));
        assert!(ChunkLayout::from_wire(6, &[2, 36, 256, 1024], "bfloat16")
            .unwrap_err()
            .contains("planes"));
        assert!(ChunkLayout::from_wire(1, &[2, 36, 256], "bfloat16")
            .unwrap_err()
            .contains("3 dims"));
        assert!(ChunkLayout::from_wire(1, &[2, 36, 0, 8], "int8")
            .unwrap_err()
            .contains("zero"));
        assert!(ChunkLayout::from_wire(1, &[2, u64::MAX / 2, 4, 8], "int8").is_err());
    }
}
