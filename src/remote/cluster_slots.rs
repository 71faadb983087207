//! Which Redis Cluster master owns a key: the key's slot (as Redis computes
//! it) and the slot ranges of a `CLUSTER SLOTS` reply. The Redis store uses
//! it after a failed cluster batch, to retry the keys node by node and give
//! up on a node that does not answer after its first key, instead of waiting
//! a timeout for each of its keys.

use redis::Value;

/// Slots of a Redis Cluster.
pub const CLUSTER_SLOTS: u16 = 16384;

/// The cluster slot of `key`: CRC16-XMODEM of the key, or of its first
/// non-empty `{tag}`, modulo 16384.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        rest.iter()
            .position(|&c| c == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16_xmodem(tagged.unwrap_or(bytes)) % CLUSTER_SLOTS
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// A master's address as `CLUSTER SLOTS` names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeAddr {
    /// Host (an IP address or a name).
    pub host: String,
    /// Port.
    pub port: u16,
}

/// The masters of the cluster's slot ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotOwners {
    /// `(first slot, last slot, master)`, as the reply lists them.
    ranges: Vec<(u16, u16, NodeAddr)>,
}

impl SlotOwners {
    /// Reads a `CLUSTER SLOTS` reply (each entry: first slot, last slot,
    /// then the master as `[host, port, ...]`, then its replicas). `None`
    /// when the reply is not of that shape.
    pub fn from_reply(reply: &Value) -> Option<Self> {
        let Value::Array(entries) = reply else {
            return None;
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(parts) = e else {
                return None;
            };
            let (first, last, master) = match parts.as_slice() {
                [Value::Int(f), Value::Int(l), Value::Array(m), ..] => (*f, *l, m),
                _ => return None,
            };
            let slot = |v: i64| u16::try_from(v).ok().filter(|s| *s < CLUSTER_SLOTS);
            let host = match master.first()? {
                Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            // Redis names an unknown endpoint "?" (or "" in older versions).
            if host.is_empty() || host == "?" {
                return None;
            }
            let port = match master.get(1)? {
                Value::Int(p) => u16::try_from(*p).ok()?,
                _ => return None,
            };
            ranges.push((slot(first)?, slot(last)?, NodeAddr { host, port }));
        }
        Some(Self { ranges })
    }

    /// Whether no range is known.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The masters, each once, in the reply's order.
    pub fn masters(&self) -> Vec<NodeAddr> {
        let mut out: Vec<NodeAddr> = Vec::new();
        for (_, _, n) in &self.ranges {
            if !out.contains(n) {
                out.push(n.clone());
            }
        }
        out
    }

    /// The master of `slot`, if a range covers it.
    pub fn owner_of(&self, slot: u16) -> Option<&NodeAddr> {
        self.ranges
            .iter()
            .find(|(first, last, _)| (*first..=*last).contains(&slot))
            .map(|(_, _, n)| n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(key_slot("foo"), 12182);
        assert_eq!(key_slot("bar"), 5061);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("{user1000}.followers"), key_slot("user1000"));
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(key_slot("foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_cluster_slots_reply_names_the_owner_of_each_slot() {
        let node = |port: i64| Value::Array(vec![bulk("10.0.0.1"), Value::Int(port), bulk("id")]);
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node(7000),
                node(7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node(7001)]),
        ]);
        let o = SlotOwners::from_reply(&reply).unwrap();
        assert_eq!(o.owner_of(0).unwrap().port, 7000);
        assert_eq!(o.owner_of(5460).unwrap().port, 7000);
        assert_eq!(o.owner_of(5461).unwrap().port, 7001);
        assert_eq!(o.owner_of(16383).unwrap().host, "10.0.0.1");
        let ports: Vec<u16> = o.masters().iter().map(|n| n.port).collect();
        assert_eq!(ports, [7000, 7001]);
        let partial = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(10),
            node(7000),
        ])]);
        assert_eq!(SlotOwners::from_reply(&partial).unwrap().owner_of(11), None);
        for bad in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(99999),
                node(1),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(1),
                node(70000),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(1),
                Value::Array(vec![]),
            ])]),
        ] {
            assert_eq!(SlotOwners::from_reply(&bad), None, "{bad:?}");
        }
    }
}
