//! PCI addresses (`domain:bus:device.function`), as the CUDA driver gives a
//! device's and sysfs names its directory.

use std::fmt;
use std::str::FromStr;

use super::NumaError;

/// A PCI function's address. Compared by value: sysfs writes the domain with
/// 4 hex digits on most machines and 8 on others (Grace), in lower case;
/// other tools may use upper case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PciAddress {
    /// The PCI domain (segment).
    pub domain: u32,
    /// The bus.
    pub bus: u8,
    /// The device on the bus.
    pub device: u8,
    /// The function of the device.
    pub function: u8,
}

impl fmt::Display for PciAddress {
    /// `0000:3b:00.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddress {
    type Err = NumaError;

    /// `domain:bus:device.function`, hex, any case and domain width.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || NumaError::BadPciAddress(s.to_string());
        let mut parts = s.trim().split(':');
        let (Some(domain), Some(bus), Some(rest), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let (device, function) = rest.split_once('.').ok_or_else(bad)?;
        let hex32 = |t: &str, max: u32| {
            if t.is_empty() || t.len() > 8 || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u32::from_str_radix(t, 16).ok().filter(|v| *v <= max)
        };
        let narrow = |v: u32| u8::try_from(v).ok();
        Ok(Self {
            domain: hex32(domain, u32::MAX).ok_or_else(bad)?,
            bus: hex32(bus, 0xff).and_then(narrow).ok_or_else(bad)?,
            device: hex32(device, 0x1f).and_then(narrow).ok_or_else(bad)?,
            function: hex32(function, 7).and_then(narrow).ok_or_else(bad)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_any_case_and_domain_width_are_one_address() {
        let a: PciAddress = "0000:3b:00.0".parse().unwrap();
        let b: PciAddress = "00000000:3B:00.0".parse().unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a,
            PciAddress {
                domain: 0,
                bus: 0x3b,
                device: 0,
                function: 0
            }
        );
        assert_eq!(a.to_string(), "0000:3b:00.0");
        let g: PciAddress = "00010009:01:1f.7".parse().unwrap();
        assert_eq!(g.domain, 0x0001_0009);
        assert_eq!((g.device, g.function), (0x1f, 7));
    }

    #[test]
    fn what_is_not_an_address_is_refused_by_name() {
        for bad in [
            "",
            "3b:00.0",
            "0000:3b:00",
            "0000:3b:00.8",
            "0000:3b:20.0",
            "0000:100:00.0",
            "0000:3b:00.0:1",
            "000g:3b:00.0",
            "0000:+3:00.0",
            "123456789:00:00.0",
        ] {
            let e = bad.parse::<PciAddress>().unwrap_err();
            assert!(
                matches!(e, NumaError::BadPciAddress(ref t) if t == bad),
                "{bad:?}: {e}"
            );
        }
    }
}
