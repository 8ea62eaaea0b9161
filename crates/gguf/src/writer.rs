//! Streaming GGUF writer: the whole directory is declared up front, the header (with every
//! tensor's offset) is written first, and tensor data is then streamed in declared order, so a
//! 17 GB model never has to sit in memory.

use std::io::Write;

use crate::{GgmlType, GgufError, Result, TensorInfo, Value, GGUF_MAGIC, GGUF_VERSION};

pub struct GgufWriter<W: Write> {
    out: W,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    /// Index of the tensor being written and bytes of it written so far.
    current: usize,
    written: u64,
    /// Bytes written since the start of the data section.
    data_pos: u64,
}

impl<W: Write> GgufWriter<W> {
    /// Writes the header. `tensors` give name, dims and type; their offsets are assigned here.
    /// `general.alignment` in `metadata`, if present, sets the alignment (default 32).
    pub fn new(
        mut out: W,
        metadata: &[(String, Value)],
        tensors: Vec<(String, Vec<u64>, GgmlType)>,
    ) -> Result<Self> {
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => crate::DEFAULT_ALIGNMENT,
            // Same rule as the reader, so whatever we write reads back.
            Some((_, v)) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 16 => a,
                _ => {
                    return Err(GgufError::metadata(
                        "general.alignment",
                        format!("{v:?} is not a power of two up to 65536"),
                    ))
                }
            },
        };
        for (key, value) in metadata {
            check_array_types(key, value)?;
        }
        let mut infos = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for (name, dims, ggml_type) in tensors {
            let info = TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            };
            offset = (offset + info.n_bytes()?).div_ceil(alignment) * alignment;
            infos.push(info);
        }
        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        header.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        header.extend_from_slice(&(infos.len() as u64).to_le_bytes());
        header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            write_string(&mut header, key);
            header.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            write_value(&mut header, value);
        }
        for t in &infos {
            write_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = (header.len() as u64).div_ceil(alignment) * alignment;
        header.resize(padded as usize, 0);
        out.write_all(&header)
            .map_err(|e| GgufError::io("<gguf output>", e))?;
        Ok(GgufWriter {
            out,
            tensors: infos,
            alignment,
            current: 0,
            written: 0,
            data_pos: 0,
        })
    }

    /// The directory as it will be read back (offsets assigned).
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Appends bytes to the current tensor; may be called several times per tensor. Tensors must
    /// be written in declared order and each exactly to its size.
    pub fn write_tensor_data(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let info = self.tensors.get(self.current).ok_or_else(|| {
            GgufError::tensor(name, "written after every declared tensor was complete")
        })?;
        if info.name != name {
            return Err(GgufError::tensor(
                name,
                format!("written out of order: expected {}", info.name),
            ));
        }
        let size = info.n_bytes()?;
        if self.written + data.len() as u64 > size {
            return Err(GgufError::tensor(
                name,
                format!("more than its {size} bytes written"),
            ));
        }
        if self.written == 0 {
            self.pad_to(info.offset)?;
        }
        self.out
            .write_all(data)
            .map_err(|e| GgufError::io("<gguf output>", e))?;
        self.written += data.len() as u64;
        self.data_pos += data.len() as u64;
        if self.written == size {
            self.current += 1;
            self.written = 0;
        }
        Ok(())
    }

    fn pad_to(&mut self, offset: u64) -> Result<()> {
        let pad = offset - self.data_pos;
        self.out
            .write_all(&vec![0u8; pad as usize])
            .map_err(|e| GgufError::io("<gguf output>", e))?;
        self.data_pos = offset;
        Ok(())
    }

    /// Checks that every tensor was written, pads the file to the alignment and returns the sink.
    pub fn finish(mut self) -> Result<W> {
        if let Some(t) = self.tensors.get(self.current) {
            return Err(GgufError::tensor(
                &t.name,
                "was declared but its data was never fully written",
            ));
        }
        let end = self.data_pos.div_ceil(self.alignment) * self.alignment;
        self.pad_to(end)?;
        self.out
            .flush()
            .map_err(|e| GgufError::io("<gguf output>", e))?;
        Ok(self.out)
    }
}

/// Arrays must hold elements of their declared type, or the file would not parse back.
fn check_array_types(key: &str, v: &Value) -> Result<()> {
    if let Value::Array(elem, items) = v {
        for item in items {
            if item.value_type() != *elem {
                return Err(GgufError::metadata(
                    key,
                    format!("array of {elem:?} holds a {:?}", item.value_type()),
                ));
            }
            check_array_types(key, item)?;
        }
    }
    Ok(())
}

fn write_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn write_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(*x as u8),
        Value::String(s) => write_string(buf, s),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Array(elem, items) => {
            buf.extend_from_slice(&(*elem as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                debug_assert_eq!(item.value_type(), *elem, "array element type mismatch");
                write_value(buf, item);
            }
        }
    }
}
