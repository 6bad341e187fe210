//! Reading `/proc/PID/maps`, `/proc/PID/smaps` and `/proc/PID/status` for the model's
//! mapping and the process's resident set. The parsers are pure; see proc(5).

use std::path::Path;

use super::samples::MappedRange;

/// The ranges of a `maps` text that map `model` (by path).
pub fn model_ranges(maps: &str, model: &Path) -> Vec<MappedRange> {
    maps.lines()
        .filter_map(|line| mapping_of(line, model))
        .collect()
}

/// `7f00-7f10 r--s 00001000 fe:00 1234   /path/model.gguf` when the path is `model`.
fn mapping_of(line: &str, model: &Path) -> Option<MappedRange> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let _perms = fields.next()?;
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let path: Vec<&str> = fields.collect();
    if path.is_empty() || Path::new(&path.join(" ")) != model {
        return None;
    }
    Some(MappedRange {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        file_offset: u64::from_str_radix(offset, 16).ok()?,
    })
}

/// Resident bytes of the model's mappings in an `smaps` text (sum of their `Rss:`).
pub fn model_rss_bytes(smaps: &str, model: &Path) -> u64 {
    let mut in_model = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            in_model = mapping_of(line, model).is_some();
        } else if in_model {
            if let Some(kb) = line.strip_prefix("Rss:") {
                total += kb_value(kb);
            }
        }
    }
    total
}

/// `VmRSS` of a `status` text, in bytes.
pub fn vm_rss_bytes(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .map(kb_value)
}

fn kb_value(text: &str) -> u64 {
    text.split_whitespace()
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Adds ranges not yet known (a mapping is seen at every sample while it lives).
pub fn merge_ranges(known: &mut Vec<MappedRange>, seen: impl IntoIterator<Item = MappedRange>) {
    for range in seen {
        if !known.contains(&range) {
            known.push(range);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = "/root/models/my model.gguf";

    #[test]
    fn finds_the_model_mapping_and_its_rss() {
        let maps = "\
55d0-55e0 r-xp 00000000 fe:00 12 /usr/bin/llama-bench
7f0000000000-7f0005c00000 r--s 001b4000 fe:00 99 /root/models/my model.gguf
7f0005c00000-7f0005c01000 rw-p 00000000 00:00 0 
7f0006000000-7f0006001000 r--s 00000000 fe:00 98 /root/models/other.gguf
";
        let ranges = model_ranges(maps, Path::new(MODEL));
        assert_eq!(
            ranges,
            vec![MappedRange {
                start: 0x7f00_0000_0000,
                end: 0x7f00_05c0_0000,
                file_offset: 0x1b_4000
            }]
        );
        assert_eq!(ranges[0].file_offset_of(0x7f00_0000_0010), Some(0x1b_4010));
        assert_eq!(ranges[0].file_offset_of(0x7f00_05c0_0000), None);

        let smaps = "\
7f0000000000-7f0005c00000 r--s 001b4000 fe:00 99 /root/models/my model.gguf
Size:              94208 kB
Rss:               40960 kB
Pss:               40960 kB
7f0005c00000-7f0005c01000 rw-p 00000000 00:00 0 
Rss:                   4 kB
";
        assert_eq!(model_rss_bytes(smaps, Path::new(MODEL)), 40960 * 1024);
        assert_eq!(
            vm_rss_bytes("Name:\tx\nVmRSS:\t  1234 kB\n"),
            Some(1234 * 1024)
        );
        assert_eq!(vm_rss_bytes("Name:\tx\n"), None);

        let mut known = ranges.clone();
        merge_ranges(&mut known, ranges.iter().copied());
        assert_eq!(known.len(), 1);
    }
}
