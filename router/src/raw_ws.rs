//! Tests' view of WebSocket frames as bytes on the wire, to check what a writer framed (the
//! libraries on either side would join fragments and hide it).

/// One WebSocket frame as written on the wire: FIN and opcode, mask, length, payload.
pub(crate) fn raw_frame(fin: bool, opcode: u8, payload: &[u8], masked: bool) -> Vec<u8> {
    let mut out = vec![u8::from(fin) << 7 | opcode];
    let mask_bit = u8::from(masked) << 7;
    match payload.len() {
        n if n < 126 => out.push(mask_bit | n as u8),
        n if n <= 0xFFFF => {
            out.push(mask_bit | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(mask_bit | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    if masked {
        // A zero mask leaves the payload as it is.
        out.extend_from_slice(&[0; 4]);
    }
    out.extend_from_slice(payload);
    out
}

/// Reads one data message off a raw socket: its frames' (FIN, opcode, length) and the payload
/// joined. Unmasks what is masked.
pub(crate) async fn raw_message(
    r: &mut (impl tokio::io::AsyncRead + Unpin),
) -> (Vec<(bool, u8, usize)>, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let (mut frames, mut joined) = (Vec::new(), Vec::new());
    loop {
        let mut head = [0u8; 2];
        r.read_exact(&mut head).await.unwrap();
        let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0F);
        let len = match head[1] & 0x7F {
            126 => usize::from(r.read_u16().await.unwrap()),
            127 => r.read_u64().await.unwrap() as usize,
            n => usize::from(n),
        };
        let mut mask = [0u8; 4];
        if head[1] & 0x80 != 0 {
            r.read_exact(&mut mask).await.unwrap();
        }
        let mut payload = vec![0; len];
        r.read_exact(&mut payload).await.unwrap();
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        frames.push((fin, opcode, len));
        joined.extend_from_slice(&payload);
        if fin {
            return (frames, joined);
        }
    }
}

/// Checks the frames of one message ([`raw_message`]) are its fragments as codex-fleet writes
/// them: a text frame first, then continuations, none above [`proto::ws::FRAGMENT_SIZE`].
pub(crate) fn assert_text_fragments(frames: &[(bool, u8, usize)]) {
    assert_eq!(frames[0].1, 1, "a text frame first");
    assert!(
        frames[1..].iter().all(|&(_, op, _)| op == 0),
        "then continuations"
    );
    assert!(frames
        .iter()
        .all(|&(_, _, len)| len <= proto::ws::FRAGMENT_SIZE));
}
