//! The render worker's protocol over its standard input and output: frames of a little-endian
//! `u32` length and a JSON body. The parent sends [`Request`]s; the worker answers each with one
//! [`Reply`].

use std::borrow::Cow;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::{ChatMessage, TemplateLimit, TemplateLimits, TokenizerError};

/// Bytes of a frame's length prefix.
pub(crate) const HEADER: usize = 4;

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request<'a> {
    /// Compiles a template for the renders that follow (replacing any earlier one).
    Load {
        source: Cow<'a, str>,
        limits: TemplateLimits,
    },
    Render(RenderArgs<'a>),
}

/// One render's inputs: [`crate::ChatTemplate::render_tools`]'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct RenderArgs<'a> {
    pub messages: Messages<'a>,
    pub tools: Option<Cow<'a, serde_json::Value>>,
    pub add_generation_prompt: bool,
    pub enable_thinking: Option<bool>,
}

/// Typed messages render as [`crate::ChatTemplate::render_tools`] does (their fields in
/// declaration order), JSON ones as [`crate::ChatTemplate::render_json`] does.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Messages<'a> {
    Chat(Cow<'a, [ChatMessage]>),
    Json(Cow<'a, serde_json::Value>),
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Reply {
    Loaded,
    Rendered(String),
    /// A compile or render error, as [`TokenizerError::Template`] words it.
    Failed(String),
    Limit(TemplateLimit),
}

impl From<Result<String, TokenizerError>> for Reply {
    fn from(r: Result<String, TokenizerError>) -> Self {
        match r {
            Ok(text) => Reply::Rendered(text),
            Err(TokenizerError::TemplateLimit(limit)) => Reply::Limit(limit),
            Err(TokenizerError::Template(msg)) => Reply::Failed(msg),
            Err(other) => Reply::Failed(other.to_string()),
        }
    }
}

impl Reply {
    /// The reply as the in-process renderer would have returned it.
    pub(crate) fn into_result(self) -> Result<String, TokenizerError> {
        match self {
            Reply::Rendered(text) => Ok(text),
            Reply::Failed(msg) => Err(TokenizerError::Template(msg)),
            Reply::Limit(limit) => Err(TokenizerError::TemplateLimit(limit)),
            Reply::Loaded => Err(TokenizerError::TemplateWorker(
                "the worker answered a render with `loaded`".into(),
            )),
        }
    }
}

/// Serialises `msg` into one frame, length first.
pub(crate) fn encode(msg: &impl Serialize) -> Vec<u8> {
    let mut frame = vec![0u8; HEADER];
    serde_json::to_writer(&mut frame, msg).expect("protocol types always serialise");
    let len = (frame.len() - HEADER) as u32;
    frame[..HEADER].copy_from_slice(&len.to_le_bytes());
    frame
}

pub(crate) fn write_frame(w: &mut impl Write, msg: &impl Serialize) -> io::Result<()> {
    w.write_all(&encode(msg))?;
    w.flush()
}

/// Reads one frame's body; `None` at a clean end of input (the parent closed the pipe).
pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; HEADER];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

/// Takes one whole frame's body off the front of `buf`, if it holds one. A frame longer than
/// `max` is refused: the worker is not trusted to size the parent's buffers.
pub(crate) fn take_frame(buf: &mut Vec<u8>, max: usize) -> Result<Option<Vec<u8>>, String> {
    let Some(len) = buf.get(..HEADER) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    if len > max {
        return Err(format!("a reply of {len} bytes (at most {max} expected)"));
    }
    if buf.len() < HEADER + len {
        return Ok(None);
    }
    let body = buf[HEADER..HEADER + len].to_vec();
    buf.drain(..HEADER + len);
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let reply = Reply::Rendered("héllo\n".into());
        let frame = encode(&reply);
        let mut buf = frame[..5].to_vec();
        assert_eq!(take_frame(&mut buf, 1 << 20), Ok(None));
        buf.extend_from_slice(&frame[5..]);
        buf.extend_from_slice(&frame);
        for _ in 0..2 {
            let body = take_frame(&mut buf, 1 << 20).unwrap().unwrap();
            let back: Reply = serde_json::from_slice(&body).unwrap();
            assert_eq!(back.into_result().unwrap(), "héllo\n");
        }
        assert!(buf.is_empty());
        let mut big = encode(&Reply::Rendered("x".repeat(100)));
        assert!(take_frame(&mut big, 50).unwrap_err().contains("bytes"));
        let mut r = &frame[..];
        assert!(read_frame(&mut r).unwrap().is_some());
        assert!(read_frame(&mut r).unwrap().is_none());
    }
}
