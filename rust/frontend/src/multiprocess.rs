//! prometheus_client's multiprocess files, read and written as the Python API servers do, so
//! the series each server counts itself (requests, tokens, latencies) are summed over every API
//! server of the fleet, Python and Rust alike, whichever one a scrape lands on.
//!
//! The format (`prometheus_client/mmap_dict.py`): a file per process and metric type
//! (`counter_<pid>.db`, `histogram_<pid>.db`) in the launcher's `PROMETHEUS_MULTIPROC_DIR`;
//! 4 bytes of used length, 4 of padding, then entries: a 4-byte key length, the key (the JSON
//! of `[metric, sample, labels, help]`) padded with spaces to 8-byte alignment, and two doubles
//! (value, timestamp). Readers take the used length first, so an entry is written before the
//! length that makes it visible. The merge and its order are `MultiProcessCollector`'s.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::exposition::{format_value, write_header, write_sample};

const INITIAL_SIZE: usize = 1 << 16;

/// One sample's identity: its metric, the sample name, labels in name order, the help text.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Key {
    pub metric: String,
    pub sample: String,
    pub labels: Vec<(String, String)>,
    pub help: String,
}

impl Key {
    pub fn new(metric: &str, sample: &str, labels: &[(&str, String)], help: &str) -> Key {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        labels.sort();
        Key {
            metric: metric.into(),
            sample: sample.into(),
            labels,
            help: help.into(),
        }
    }

    /// The JSON prometheus_client keys its entries by (`json.dumps(..., sort_keys=True)`).
    fn json(&self) -> String {
        let s = |v: &str| serde_json::to_string(v).expect("a string");
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{}: {}", s(k), s(v)))
            .collect();
        format!(
            "[{}, {}, {{{}}}, {}]",
            s(&self.metric),
            s(&self.sample),
            labels.join(", "),
            s(&self.help)
        )
    }

    fn parse(json: &str) -> Option<Key> {
        let (metric, sample, labels, help): (String, String, BTreeMap<String, String>, String) =
            serde_json::from_str(json).ok()?;
        Some(Key {
            metric,
            sample,
            labels: labels.into_iter().collect(),
            help,
        })
    }
}

/// This process's file of one metric type, mapped shared as prometheus_client maps its own
/// (a value changes with a store to memory, not a system call per token).
pub struct DbFile {
    file: File,
    map: *mut u8,
    used: usize,
    capacity: usize,
}

// The mapping is owned by this value alone and used under the caller's lock.
unsafe impl Send for DbFile {}

impl DbFile {
    pub fn create(directory: &Path, kind: &str) -> std::io::Result<DbFile> {
        let path = directory.join(format!("{kind}_{}.db", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len(INITIAL_SIZE as u64)?;
        let mut db = DbFile {
            map: map(&file, INITIAL_SIZE)?,
            file,
            used: 8,
            capacity: INITIAL_SIZE,
        };
        db.write(0, &8u32.to_le_bytes());
        Ok(db)
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        assert!(
            at + bytes.len() <= self.capacity,
            "a write inside the mapping"
        );
        // SAFETY: in bounds of a live shared mapping of `capacity` bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.add(at), bytes.len()) }
    }

    /// Set the value at `position` (from `append`).
    pub fn write_value(&mut self, position: usize, value: f64) {
        self.write(position, &value.to_le_bytes());
    }

    /// A new entry for `key` at 0; returns where its value is.
    pub fn append(&mut self, key: &Key) -> std::io::Result<usize> {
        let encoded = key.json();
        let pad = 8 - (encoded.len() + 4) % 8;
        let mut entry = Vec::with_capacity(4 + encoded.len() + pad + 16);
        entry.extend_from_slice(&(encoded.len() as u32).to_le_bytes());
        entry.extend_from_slice(encoded.as_bytes());
        entry.extend(std::iter::repeat_n(b' ', pad));
        entry.extend_from_slice(&[0u8; 16]);
        if self.used + entry.len() > self.capacity {
            let mut capacity = self.capacity;
            while self.used + entry.len() > capacity {
                capacity *= 2;
            }
            self.file.set_len(capacity as u64)?;
            let grown = map(&self.file, capacity)?;
            self.unmap();
            self.map = grown;
            self.capacity = capacity;
        }
        let at = self.used;
        self.write(at, &entry);
        self.used += entry.len();
        // Last: readers see the entry only once it is whole.
        self.write(0, &(self.used as u32).to_le_bytes());
        Ok(self.used - 16)
    }

    fn unmap(&mut self) {
        // SAFETY: `map` came from mmap with this `capacity` and is not used after this.
        unsafe { libc::munmap(self.map.cast(), self.capacity) };
    }
}

impl Drop for DbFile {
    fn drop(&mut self) {
        self.unmap();
    }
}

fn map(file: &File, capacity: usize) -> std::io::Result<*mut u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: a shared read-write mapping of a file this process opened read-write and sized
    // to at least `capacity` bytes.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            capacity,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(map.cast())
}

/// Every entry of one file, in file order: (key, value). A file being written is read up to
/// the used length it announced.
fn read_entries(path: &Path) -> std::io::Result<Vec<(Key, f64)>> {
    let mut data = Vec::new();
    File::open(path)?.read_to_end(&mut data)?;
    let int = |at: usize| -> Option<usize> {
        let bytes = data.get(at..at + 4)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?) as usize)
    };
    let used = int(0).unwrap_or(0).min(data.len());
    let mut entries = Vec::new();
    let mut at = 8;
    while at < used {
        let Some(length) = int(at) else { break };
        let key = data.get(at + 4..at + 4 + length);
        at += 4 + length + (8 - (length + 4) % 8);
        let value = data.get(at..at + 8);
        at += 16;
        let (Some(key), Some(value)) = (key, value) else {
            break;
        };
        let value = f64::from_le_bytes(value.try_into().expect("8 bytes"));
        if let Some(key) = std::str::from_utf8(key).ok().and_then(Key::parse) {
            entries.push((key, value));
        }
    }
    Ok(entries)
}

/// The `.db` files of a directory, with their metric type, in file-name order (the order
/// the Python servers merge them in: float sums taken in another order can end 1 ulp apart,
/// and every server of a fleet must render the same value).
pub fn read_directory(directory: &Path) -> Vec<(String, Vec<(Key, f64)>)> {
    let Ok(listing) = std::fs::read_dir(directory) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = listing
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "db"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?;
            let kind = name.split('_').next()?.to_string();
            Some((kind, read_entries(&path).ok()?))
        })
        .collect()
}

type Labels = Vec<(String, String)>;

/// Sums per label set, label sets and samples in the order first seen.
#[derive(Default)]
struct Groups {
    order: Vec<Labels>,
    samples: HashMap<Labels, Vec<(String, Labels, f64)>>,
}

impl Groups {
    fn group(&mut self, labels: &Labels) -> &mut Vec<(String, Labels, f64)> {
        if !self.samples.contains_key(labels) {
            self.order.push(labels.clone());
        }
        self.samples.entry(labels.clone()).or_default()
    }

    fn add(&mut self, name: &str, labels: &Labels, value: f64) {
        let group = self.group(labels);
        match group.iter_mut().find(|(n, l, _)| n == name && l == labels) {
            Some(sample) => sample.2 += value,
            None => group.push((name.to_string(), labels.clone(), value)),
        }
    }

    fn set(&mut self, name: &str, labels: Labels, group: &Labels, value: f64) {
        let samples = self.group(group);
        match samples
            .iter_mut()
            .find(|(n, l, _)| n == name && *l == labels)
        {
            Some(sample) => sample.2 = value,
            None => samples.push((name.to_string(), labels, value)),
        }
    }
}

/// The families named in `names` (sorted), merged over `files` as MultiProcessCollector
/// merges them (counters and histogram sums summed, buckets accumulated in bound order, the
/// count after them), written as the Python servers write them.
pub fn render(out: &mut String, files: &[(String, Vec<(Key, f64)>)], names: &[&str]) {
    let mut names = names.to_vec();
    names.sort();
    for metric in names {
        let mut help_and_kind: Option<(&str, &str)> = None;
        let mut groups = Groups::default();
        let mut buckets: Vec<(Labels, Vec<(f64, f64)>)> = Vec::new();
        for (kind, entries) in files {
            for (key, value) in entries.iter().filter(|(key, _)| key.metric == metric) {
                help_and_kind.get_or_insert((&key.help, kind));
                let le = key.labels.iter().find(|(k, _)| k == "le");
                match (kind.as_str(), le) {
                    ("histogram", Some((_, bound))) => {
                        let bound = parse_bound(bound);
                        let without: Labels = key
                            .labels
                            .iter()
                            .filter(|(k, _)| k != "le")
                            .cloned()
                            .collect();
                        let index = match buckets.iter().position(|(l, _)| *l == without) {
                            Some(index) => index,
                            None => {
                                buckets.push((without, Vec::new()));
                                buckets.len() - 1
                            }
                        };
                        let bounds = &mut buckets[index].1;
                        match bounds.iter_mut().find(|(b, _)| *b == bound) {
                            Some(entry) => entry.1 += value,
                            None => bounds.push((bound, *value)),
                        }
                    }
                    _ => groups.add(&key.sample, &key.labels, *value),
                }
            }
        }
        let Some((help, kind)) = help_and_kind else {
            continue;
        };
        for (labels, mut bounds) in buckets {
            bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut total = 0.0;
            for (bound, value) in bounds {
                total += value;
                let mut with_le = labels.clone();
                with_le.push(("le".to_string(), format_value(bound)));
                with_le.sort();
                groups.set(&format!("{metric}_bucket"), with_le, &labels, total);
            }
            groups.set(&format!("{metric}_count"), labels.clone(), &labels, total);
        }
        let family = if kind == "counter" {
            format!("{metric}_total")
        } else {
            metric.to_string()
        };
        write_header(out, &family, help, kind);
        for labels in &groups.order {
            for (name, sample_labels, value) in &groups.samples[labels] {
                let borrowed: Vec<(&str, String)> = sample_labels
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.clone()))
                    .collect();
                write_sample(out, name, &borrowed, *value);
            }
        }
    }
}

fn parse_bound(text: &str) -> f64 {
    match text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        _ => text.parse().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::{read_directory, read_entries, DbFile, Key};

    #[test]
    fn a_directory_is_read_in_file_name_order() {
        // Float sums depend on their order, and the Python servers merge in name order.
        let directory =
            std::env::temp_dir().join(format!("rankcast-db-order-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let key = Key::new("x", "x_total", &[], "help");
        for (name, value) in [
            ("counter_c.db", 3.0),
            ("counter_a.db", 1.0),
            ("counter_b.db", 2.0),
        ] {
            let mut db = DbFile::create(&directory, "counter").unwrap();
            let at = db.append(&key).unwrap();
            db.write_value(at, value);
            drop(db);
            let written = directory.join(format!("counter_{}.db", std::process::id()));
            std::fs::rename(written, directory.join(name)).unwrap();
        }
        let values: Vec<f64> = read_directory(&directory)
            .into_iter()
            .map(|(kind, entries)| {
                assert_eq!(kind, "counter");
                entries[0].1
            })
            .collect();
        assert_eq!(values, [1.0, 2.0, 3.0]);
        std::fs::remove_dir_all(&directory).unwrap();
    }

    #[test]
    fn what_is_written_reads_back_with_its_key_and_grows_past_the_first_size() {
        let directory = std::env::temp_dir().join(format!("rankcast-db-{}", std::process::id()));
        std::fs::create_dir_all(&directory).unwrap();
        let mut db = DbFile::create(&directory, "counter").unwrap();
        let labels = [("model_name", "m\u{e9}".to_string())];
        let first = Key::new("c", "c_total", &labels, "help \"quoted\"");
        let at = db.append(&first).unwrap();
        db.write_value(at, 2.5);
        for i in 0..2000 {
            let key = Key::new("c", "c_total", &[("i", i.to_string())], "help");
            let at = db.append(&key).unwrap();
            db.write_value(at, 1.0);
        }
        db.write_value(at, 2.5);
        let path = directory.join(format!("counter_{}.db", std::process::id()));
        let entries = read_entries(&path).unwrap();
        assert_eq!(entries.len(), 2001);
        assert_eq!(entries[0], (first, 2.5));
        assert!(std::fs::metadata(&path).unwrap().len() > 1 << 16);
        std::fs::remove_dir_all(&directory).unwrap();
    }
}
