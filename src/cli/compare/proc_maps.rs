//! Reading `/proc/PID/maps`, `/proc/PID/smaps` and `/proc/PID/status` for the model's
//! mappings and the process's resident set. The parsers are pure; see proc(5).

use std::path::Path;

use super::model_files::ModelFiles;
use super::samples::MappedRange;

/// The ranges of a `maps` text that map any of the model's files (by path), with
/// offsets on the model axis (`model_files`).
pub fn model_ranges(maps: &str, model: &ModelFiles) -> Vec<MappedRange> {
    maps.lines()
        .filter_map(|line| mapping_of(line, model))
        .collect()
}

/// `7f00-7f10 r--s 00001000 fe:00 1234   /path/model.gguf` when the path is one of
/// the model's files.
fn mapping_of(line: &str, model: &ModelFiles) -> Option<MappedRange> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let _perms = fields.next()?;
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let path: Vec<&str> = fields.collect();
    if path.is_empty() {
        return None;
    }
    let part = model.part(Path::new(&path.join(" ")))?;
    Some(MappedRange {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        model_offset: part.model_offset(u64::from_str_radix(offset, 16).ok()?),
    })
}

/// Resident bytes of the model's mappings, of any of its files, in an `smaps` text
/// (sum of their `Rss:`).
pub fn model_rss_bytes(smaps: &str, model: &ModelFiles) -> u64 {
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
    use std::path::PathBuf;

    const MODEL: &str = "/root/models/my model.gguf";

    fn one_file() -> ModelFiles {
        ModelFiles::new([(PathBuf::from(MODEL), 0x600_0000)]).unwrap()
    }

    #[test]
    fn finds_the_model_mapping_and_its_rss() {
        let maps = "\
55d0-55e0 r-xp 00000000 fe:00 12 /usr/bin/llama-bench
7f0000000000-7f0005c00000 r--s 001b4000 fe:00 99 /root/models/my model.gguf
7f0005c00000-7f0005c01000 rw-p 00000000 00:00 0 
7f0006000000-7f0006001000 r--s 00000000 fe:00 98 /root/models/other.gguf
";
        let ranges = model_ranges(maps, &one_file());
        assert_eq!(
            ranges,
            vec![MappedRange {
                start: 0x7f00_0000_0000,
                end: 0x7f00_05c0_0000,
                model_offset: 0x1b_4000
            }]
        );
        assert_eq!(ranges[0].model_offset_of(0x7f00_0000_0010), Some(0x1b_4010));
        assert_eq!(ranges[0].model_offset_of(0x7f00_05c0_0000), None);

        let smaps = "\
7f0000000000-7f0005c00000 r--s 001b4000 fe:00 99 /root/models/my model.gguf
Size:              94208 kB
Rss:               40960 kB
Pss:               40960 kB
7f0005c00000-7f0005c01000 rw-p 00000000 00:00 0 
Rss:                   4 kB
";
        assert_eq!(model_rss_bytes(smaps, &one_file()), 40960 * 1024);
        assert_eq!(
            vm_rss_bytes("Name:\tx\nVmRSS:\t  1234 kB\n"),
            Some(1234 * 1024)
        );
        assert_eq!(vm_rss_bytes("Name:\tx\n"), None);

        let mut known = ranges.clone();
        merge_ranges(&mut known, ranges.iter().copied());
        assert_eq!(known.len(), 1);
    }

    /// Three parts of 40 MiB + 1 byte, 40 MiB and 10 MiB: the second starts on the model
    /// axis at the page after the first's end.
    fn three_parts() -> ModelFiles {
        ModelFiles::new([
            (PathBuf::from("/m/s-00001-of-00003.gguf"), (40 << 20) + 1),
            (PathBuf::from("/m/s-00002-of-00003.gguf"), 40 << 20),
            (PathBuf::from("/m/s-00003-of-00003.gguf"), 10 << 20),
        ])
        .unwrap()
    }

    #[test]
    fn every_part_of_a_split_model_is_the_models() {
        let model = three_parts();
        let second = (40 << 20) + 4096;
        let third = second + (40 << 20);
        let maps = "\
55d0-55e0 r-xp 00000000 fe:00 12 /usr/bin/llama-bench
7f0000000000-7f0002801000 r--s 00000000 fe:00 91 /m/s-00001-of-00003.gguf
7f1000000000-7f1002800000 r--s 00000000 fe:00 92 /m/s-00002-of-00003.gguf
7f2000000000-7f2000a00000 r--s 00000000 fe:00 93 /m/s-00003-of-00003.gguf
7f3000000000-7f3000001000 r--s 00000000 fe:00 94 /m/s-00001-of-00004.gguf
";
        let ranges = model_ranges(maps, &model);
        assert_eq!(ranges.len(), 3, "{ranges:?}");
        assert_eq!(ranges[0].model_offset_of(0x7f00_0000_2000), Some(0x2000));
        assert_eq!(
            ranges[1].model_offset_of(0x7f10_0000_2000),
            Some(second + 0x2000)
        );
        assert_eq!(ranges[2].model_offset_of(0x7f20_0000_0000), Some(third));
        // The address of the fourth mapping belongs to a file of another model.
        assert!(ranges
            .iter()
            .all(|r| r.model_offset_of(0x7f30_0000_0000).is_none()));

        let smaps = "\
7f0000000000-7f0002801000 r--s 00000000 fe:00 91 /m/s-00001-of-00003.gguf
Rss:               1000 kB
7f0005c00000-7f0005c01000 rw-p 00000000 00:00 0 
Rss:                  4 kB
7f1000000000-7f1002800000 r--s 00000000 fe:00 92 /m/s-00002-of-00003.gguf
Size:              40960 kB
Rss:               2000 kB
7f2000000000-7f2000a00000 r--s 00000000 fe:00 93 /m/s-00003-of-00003.gguf
Rss:                300 kB
7f3000000000-7f3000001000 r--s 00000000 fe:00 94 /m/s-00001-of-00004.gguf
Rss:                  4 kB
";
        assert_eq!(model_rss_bytes(smaps, &model), 3300 * 1024);
    }
}
