//! Deterministic arbitrary frames and request ids for property tests of everything that reads
//! or rewrites frames (here and in the router), so both test the same inputs.

use crate::rpc::RequestId;

/// A small deterministic generator (xorshift64*), so failures reproduce from the seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    pub fn id(&mut self) -> RequestId {
        match self.below(6) {
            0 => RequestId::Int(*self.pick(&[0, -1, 1, i64::MAX, i64::MIN, 9_007_199_254_740_993])),
            1 | 2 => RequestId::Int(self.next_u64() as i64),
            3 => RequestId::Str(String::new()),
            _ => {
                let parts = [
                    "a",
                    "\"",
                    "\\",
                    "é",
                    "\u{1F600}",
                    "\n",
                    "\u{0}",
                    "id-",
                    "7",
                    " ",
                ];
                RequestId::Str((0..self.below(12)).map(|_| *self.pick(&parts)).collect())
            }
        }
    }
}

const FRAMES: &[&str] = &[
    r#"{"id":1,"method":"thread/start","params":{"cwd":"/w"}}"#,
    r#"{"id":"initialize","method":"initialize","params":{"clientInfo":{"name":"x","version":"1"}}}"#,
    r#"{"method":"initialized"}"#,
    r#"{"id":5,"result":{"decision":"accept"}}"#,
    r#"{"id":6,"error":{"code":-32001,"message":"Server overloaded; retry later."}}"#,
    r#"{"method":"serverRequest/resolved","params":{"threadId":"t","requestId":3}}"#,
    r#"[{"id":1,"method":"a"}]"#,
    r#"{"id":null,"method":"a"}"#,
    r#"{"id":3.5,"method":"a"}"#,
    r#""just a string""#,
];

/// Random bytes, or a known frame mutated: truncated, spliced, bytes flipped or inserted.
pub fn arbitrary_frame(rng: &mut Rng) -> String {
    let tokens = [
        "{", "}", "[", "]", "\"", ":", ",", "null", "-32001", "\"id\"", "\\u", "1e999", "\u{FFFD}",
    ];
    match rng.below(4) {
        0 => {
            let bytes: Vec<u8> = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        1 => {
            let f = rng.pick(FRAMES);
            let cut = rng.below(f.len() + 1);
            f.get(..cut).unwrap_or(f).to_owned()
        }
        _ => {
            let mut f: Vec<char> = rng.pick(FRAMES).chars().collect();
            for _ in 0..=rng.below(4) {
                let at = rng.below(f.len() + 1);
                match rng.below(3) {
                    0 if !f.is_empty() => {
                        f.remove(at.min(f.len() - 1));
                    }
                    1 => f.splice(at..at, rng.pick(&tokens).chars()).for_each(drop),
                    _ => f.insert(at, char::from(rng.next_u64() as u8 & 0x7f)),
                }
            }
            f.into_iter().collect()
        }
    }
}
