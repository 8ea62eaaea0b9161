//! A target that misbehaves on command, so the harness's own tests can see each failure caught.

use super::Target;

pub struct SelfTest;

impl Target for SelfTest {
    fn name(&self) -> &'static str {
        "selftest"
    }

    fn max_len(&self) -> usize {
        64
    }

    fn dict(&self) -> &'static [&'static [u8]] {
        &[]
    }

    fn run(&mut self, input: &[u8]) -> Result<String, String> {
        match input {
            b"PANIC" => panic!("selftest panic"),
            b"WRONG" => Err("selftest property".into()),
            b"ABORT" => std::process::abort(),
            b"HANG" => loop {
                std::thread::sleep(std::time::Duration::from_millis(50));
            },
            b"ALLOC" => {
                let v = vec![1u8; 64 << 30];
                Ok(format!("allocated {}", v.len()))
            }
            _ => Ok(format!("len {}", input.len().min(4))),
        }
    }
}
