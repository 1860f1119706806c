//! Config loading: TOML, every key has a default, an unknown key or a bad
//! value is an error that names the key (`storage.segment_size: ...`).

use std::fmt;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::RuntimeError;

/// Parses a TOML document into `T`; errors name the offending key path.
pub fn from_toml_str<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, RuntimeError> {
    let de = toml::Deserializer::parse(text)
        .map_err(|e| RuntimeError::Config(format!("{origin}: {}", one_line(&e.to_string()))))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = one_line(&e.inner().to_string());
        RuntimeError::Config(format!("{origin}: key `{path}`: {inner}"))
    })
}

/// Reads and parses a TOML file into `T`.
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T, RuntimeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RuntimeError::Config(format!("cannot read {}: {e}", path.display())))?;
    from_toml_str(&text, &path.display().to_string())
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A byte count: a plain number, or a string with a unit (`"64 MiB"`, `"1GiB"`,
/// `"4096"`). KiB/MiB/GiB are powers of 1024; KB/MB/GB powers of 1000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const fn kib(n: u64) -> Self {
        Self(n * 1024)
    }
    pub const fn mib(n: u64) -> Self {
        Self(n * 1024 * 1024)
    }
    pub const fn gib(n: u64) -> Self {
        Self(n * 1024 * 1024 * 1024)
    }
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::str::FromStr for Bytes {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.is_empty() {
            return Err("empty byte size".into());
        }
        if t.starts_with('-') {
            return Err(format!("byte size {s:?} is negative"));
        }
        let v: bytesize::ByteSize = t
            .parse()
            .map_err(|e: String| format!("bad byte size {s:?}: {e}"))?;
        if v.0 == u64::MAX {
            return Err(format!("byte size {s:?} is too large"));
        }
        Ok(Bytes(v.0))
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{} {name}", self.0 / size);
            }
        }
        write!(f, "{} B", self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a byte count: a number, or a string such as \"64 MiB\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Bytes, E> {
                u64::try_from(v)
                    .map(Bytes)
                    .map_err(|_| E::custom(format!("byte size {v} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Bytes, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(unused)] // only the parsing matters here
    struct Inner {
        #[serde(default)]
        size: Bytes,
        #[serde(default)]
        ttl_ms: u64,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        #[serde(default)]
        #[allow(unused)] // only the parsing matters here
        inner: Option<Inner>,
    }

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!("4096".parse::<Bytes>().unwrap(), Bytes(4096));
        assert_eq!("64 MiB".parse::<Bytes>().unwrap(), Bytes::mib(64));
        assert_eq!("1GiB".parse::<Bytes>().unwrap(), Bytes::gib(1));
        assert_eq!("2 KiB".parse::<Bytes>().unwrap(), Bytes::kib(2));
        assert!("12 parsecs".parse::<Bytes>().is_err());
        assert!("-1".parse::<Bytes>().is_err());
        assert!("".parse::<Bytes>().is_err());
        assert_eq!(Bytes::mib(64).to_string(), "64 MiB");
    }

    #[test]
    fn unknown_key_error_names_the_key() {
        let e = from_toml_str::<Outer>("[inner]\nsise = 3\n", "test.toml").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("sise"), "{msg}");
    }

    #[test]
    fn bad_value_error_names_the_key_path() {
        let e = from_toml_str::<Outer>("[inner]\nttl_ms = \"soon\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("inner.ttl_ms"), "{e}");
        let e = from_toml_str::<Outer>("[inner]\nsize = \"12 parsecs\"\n", "t").unwrap_err();
        assert!(e.to_string().contains("inner.size"), "{e}");
    }
}
