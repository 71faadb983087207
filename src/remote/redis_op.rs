//! One command of a Redis batch: the crate's `Cmd` (for the cluster
//! client) or RESP bytes appended to a pipeline buffer.

/// One command of a batch.
pub(super) enum Op<'a> {
    Set(&'a str, &'a [u8]),
    Get(&'a str),
    Exists(&'a str),
}

impl Op<'_> {
    pub(super) fn key(&self) -> &str {
        match *self {
            Op::Set(k, _) | Op::Get(k) | Op::Exists(k) => k,
        }
    }

    pub(super) fn cmd(&self) -> redis::Cmd {
        match *self {
            Op::Set(k, v) => {
                let mut c = redis::cmd("SET");
                c.arg(k).arg(v);
                c
            }
            Op::Get(k) => {
                let mut c = redis::cmd("GET");
                c.arg(k);
                c
            }
            Op::Exists(k) => {
                let mut c = redis::cmd("EXISTS");
                c.arg(k);
                c
            }
        }
    }
}

/// The standalone pipeline buffer is given back beyond this size.
pub(super) const KEPT_PACKED_BYTES: usize = 64 << 20;

impl Op<'_> {
    /// Appends the command in RESP (an array of bulk strings).
    pub(super) fn pack(&self, out: &mut Vec<u8>) {
        let (name, key, value): (&[u8], &str, Option<&[u8]>) = match *self {
            Op::Set(k, v) => (b"SET", k, Some(v)),
            Op::Get(k) => (b"GET", k, None),
            Op::Exists(k) => (b"EXISTS", k, None),
        };
        let bulk = |out: &mut Vec<u8>, b: &[u8]| {
            out.push(b'$');
            out.extend_from_slice(b.len().to_string().as_bytes());
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(b);
            out.extend_from_slice(b"\r\n");
        };
        out.extend_from_slice(if value.is_some() {
            b"*3\r\n"
        } else {
            b"*2\r\n"
        });
        bulk(out, name);
        bulk(out, key.as_bytes());
        if let Some(v) = value {
            bulk(out, v);
        }
    }
}
