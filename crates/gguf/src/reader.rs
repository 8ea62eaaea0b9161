//! GGUF parsing. Every count and length in the header is checked against the bytes that are
//! actually left before anything is allocated, so a hostile header fails fast with a clear error.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::{
    GgmlType, GgufError, Result, TensorInfo, Value, ValueType, DEFAULT_ALIGNMENT, GGUF_MAGIC,
};

const MAX_TENSORS: u64 = 1 << 20;
const MAX_KV: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;
const MAX_ARRAY_DEPTH: u32 = 4;

/// The parsed header: metadata and the tensor directory, with data offsets resolved.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufHeader {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| GgufError::Other(format!("{what}: string is not valid UTF-8")))
    }

    fn count(&mut self, what: &str, min_elem_bytes: u64, limit: u64) -> Result<u64> {
        let n = self.u64(what)?;
        let fits = self.remaining() / min_elem_bytes.max(1);
        if n > limit || n > fits {
            return Err(GgufError::Absurd {
                what: what.to_string(),
                value: n,
                limit: limit.min(fits),
            });
        }
        Ok(n)
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(key)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(key)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            ValueType::U32 => Value::U32(self.u32(key)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            ValueType::Bool => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::metadata(
                        key,
                        format!("bool byte is {b}, not 0 or 1"),
                    ))
                }
            },
            ValueType::String => Value::String(self.string(key)?),
            ValueType::U64 => Value::U64(self.u64(key)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            ValueType::Array => self.array_value(key, depth)?,
        })
    }

    fn array_value(&mut self, key: &str, depth: u32) -> Result<Value> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::metadata(key, "arrays nested too deeply"));
        }
        let elem = ValueType::from_id(self.u32(key)?)
            .map_err(|e| GgufError::metadata(key, e.to_string()))?;
        let min = match elem {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::String | ValueType::U64 | ValueType::I64 | ValueType::F64 => 8,
            ValueType::Array => 12,
        };
        let n = self.count(&format!("{key} array length"), min, u64::MAX)?;
        let mut items = Vec::with_capacity(n as usize);
        for _ in 0..n {
            items.push(self.value(elem, key, depth + 1)?);
        }
        Ok(Value::Array(elem, items))
    }
}

/// Parses a GGUF header from the start of `buf` (the whole file, so that tensor extents can be
/// checked against its length).
pub fn parse_header(buf: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::BadVersion(version));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Each tensor entry needs at least 8+4+8+4+8 bytes, each kv at least 8+4+1.
    for (what, n, min, limit) in [
        ("tensor count", n_tensors, 32, MAX_TENSORS),
        ("metadata count", n_kv, 13, MAX_KV),
    ] {
        if n > limit || n > c.remaining() / min {
            return Err(GgufError::Absurd {
                what: what.into(),
                value: n,
                limit: limit.min(c.remaining() / min),
            });
        }
    }
    let metadata = parse_metadata(&mut c, n_kv)?;
    let mut meta_index = HashMap::with_capacity(metadata.len());
    for (i, (key, _)) in metadata.iter().enumerate() {
        // Which of two values a reader uses is arbitrary (llama.cpp takes the first, a map the
        // last), so a file that says two things is refused.
        if meta_index.insert(key.clone(), i).is_some() {
            return Err(GgufError::metadata(key, "appears twice in the metadata"));
        }
    }
    let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a,
            _ => {
                return Err(GgufError::metadata(
                    "general.alignment",
                    format!("{v:?} is not a power of two up to 65536"),
                ))
            }
        },
    };
    let tensors = parse_tensor_infos(&mut c, n_tensors)?;
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensor_index = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        check_extent(t, alignment, data_offset, buf.len() as u64)?;
        if tensor_index.insert(t.name.clone(), i).is_some() {
            return Err(GgufError::tensor(
                &t.name,
                "appears twice in the tensor directory",
            ));
        }
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
        meta_index,
        tensor_index,
    })
}

fn parse_metadata(c: &mut Cursor<'_>, n_kv: u64) -> Result<Vec<(String, Value)>> {
    let mut metadata = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty = ValueType::from_id(c.u32(&key)?)
            .map_err(|e| GgufError::metadata(&key, e.to_string()))?;
        let value = c.value(ty, &key, 0)?;
        metadata.push((key, value));
    }
    Ok(metadata)
}

fn parse_tensor_infos(c: &mut Cursor<'_>, n_tensors: u64) -> Result<Vec<TensorInfo>> {
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&format!("tensor name #{i}"))?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::tensor(
                &name,
                format!("has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        if dims.iter().any(|&d| d == 0 || d > 1 << 40) {
            return Err(GgufError::tensor(
                &name,
                format!("has an absurd shape {dims:?}"),
            ));
        }
        let ggml_type = GgmlType::from_id(c.u32(&name)?)
            .map_err(|e| GgufError::tensor(&name, e.to_string()))?;
        let offset = c.u64(&name)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    Ok(tensors)
}

fn check_extent(t: &TensorInfo, alignment: u64, data_offset: u64, file_len: u64) -> Result<()> {
    if t.offset % alignment != 0 {
        return Err(GgufError::tensor(
            &t.name,
            format!("offset {} is not aligned to {alignment}", t.offset),
        ));
    }
    let n_elements = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if n_elements.is_none() {
        return Err(GgufError::tensor(
            &t.name,
            format!("element count of shape {:?} overflows", t.dims),
        ));
    }
    // A row that is not whole blocks is reported as such, not as running past the end.
    let n_bytes = t.n_bytes()?;
    match data_offset.checked_add(t.offset).and_then(|s| s.checked_add(n_bytes)) {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(GgufError::tensor(
            &t.name,
            format!(
                "data ({n_bytes} bytes at offset {}) runs past the end of the file ({file_len} bytes)",
                data_offset.saturating_add(t.offset)
            ),
        )),
    }
}

/// A GGUF file mapped into memory. Tensor data is borrowed straight from the mapping.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: GgufHeader,
    mmap: memmap2::Mmap,
}

/// A tensor's directory entry and its bytes in the mapping.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| GgufError::io(&path, e))?;
        // SAFETY: the mapping is read-only; a file truncated underneath us is the caller's risk,
        // as with every mmap-based model loader.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(&path, e))?;
        let header = parse_header(&mmap).map_err(|e| match e {
            GgufError::Io { .. } => e,
            other => GgufError::Other(format!("{}: {other}", path.display())),
        })?;
        Ok(GgufFile { path, header, mmap })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.get(key)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let info = self.header.tensor_info(name)?;
        let start = (self.header.data_offset + info.offset) as usize;
        let len = info.n_bytes().ok()? as usize;
        Some(TensorView {
            info,
            data: &self.mmap[start..start + len],
        })
    }

    /// The whole mapping (for backends that upload or prefetch the data section in bulk).
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }
}
