//! Slurm host lists (`node[01-04,07]`, `a,b`, `gpu-[3-5]`, `rack[1-2]-n[1-2]`): the
//! first host is rank 0's, where the rendezvous listens.

/// Most hosts of a Slurm job: the longest tasks-per-node list
/// [`super::env::tasks_per_node`] expands.
pub const NODELIST_HOSTS_MAX: usize = 65_536;

/// Splits at commas outside brackets.
fn top_level_items(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                depth += 1;
                if depth > 1 {
                    return Err(format!("`{list}`: nested `[` at byte {i}"));
                }
            }
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("`{list}`: `]` without `[` at byte {i}"));
                }
            }
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("`{list}`: `[` without `]`"));
    }
    items.push(&list[start..]);
    if items.iter().any(|s| s.trim().is_empty()) {
        return Err(format!("`{list}`: an empty host name"));
    }
    Ok(items)
}

/// A piece of one host pattern: literal text or a bracket of numeric ranges.
enum Piece<'a> {
    Text(&'a str),
    /// `(start, end, width)`: numbers `start..=end`, zero-padded to `width`.
    Ranges(Vec<(u64, u64, usize)>),
}

fn pieces(item: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            out.push(Piece::Text(&rest[..open]));
        }
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| format!("`{item}`: `[` without `]`"))?;
        let mut ranges = Vec::new();
        for r in rest[open + 1..close].split(',') {
            let (a, b) = match r.split_once('-') {
                Some((a, b)) => (a, b),
                None => (r, r),
            };
            let num = |s: &str| {
                if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
                    Err(format!("`{item}`: `{r}` is not a number or a range a-b"))
                } else {
                    s.parse::<u64>()
                        .map_err(|_| format!("`{item}`: `{s}` is too large"))
                }
            };
            let (lo, hi) = (num(a)?, num(b)?);
            if hi < lo {
                return Err(format!("`{item}`: range `{r}` runs backwards"));
            }
            ranges.push((lo, hi, a.len()));
        }
        out.push(Piece::Ranges(ranges));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    Ok(out)
}

/// The first host of a Slurm host list (without expanding the rest).
pub fn first_host(list: &str) -> Result<String, String> {
    let items = top_level_items(list.trim())?;
    let mut host = String::new();
    for p in pieces(items[0].trim())? {
        match p {
            Piece::Text(t) => host.push_str(t),
            Piece::Ranges(r) => {
                let (lo, _, width) = r[0];
                host.push_str(&format!("{lo:0width$}"));
            }
        }
    }
    // Validate the rest of the list too, so a typo is reported on every rank alike.
    for item in &items[1..] {
        pieces(item.trim())?;
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every host of a Slurm host list, in order.
    ///
    /// # Errors
    /// Unbalanced or nested brackets, a range that is not `a` or `a-b` in digits, a
    /// backwards range, an empty name, or more than [`NODELIST_HOSTS_MAX`] hosts.
    fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
        let mut hosts = Vec::new();
        for item in top_level_items(list.trim())? {
            let mut partial = vec![String::new()];
            for p in pieces(item.trim())? {
                match p {
                    Piece::Text(t) => partial.iter_mut().for_each(|h| h.push_str(t)),
                    Piece::Ranges(ranges) => {
                        let mut next = Vec::new();
                        for h in &partial {
                            for &(lo, hi, width) in &ranges {
                                for v in lo..=hi {
                                    next.push(format!("{h}{v:0width$}"));
                                    if next.len() + hosts.len() > NODELIST_HOSTS_MAX {
                                        return Err(format!(
                                            "`{list}`: more than {NODELIST_HOSTS_MAX} hosts"
                                        ));
                                    }
                                }
                            }
                        }
                        partial = next;
                    }
                }
            }
            hosts.extend(partial);
        }
        Ok(hosts)
    }

    #[test]
    fn first_hosts() {
        assert_eq!(first_host("node[01-04,07]").unwrap(), "node01");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert_eq!(first_host("gpu-[3-5]").unwrap(), "gpu-3");
        assert_eq!(first_host("single").unwrap(), "single");
        assert_eq!(first_host("rack[2-3]-n[010-012]").unwrap(), "rack2-n010");
        assert_eq!(first_host("x[7],y[1-2]").unwrap(), "x7");
    }

    #[test]
    fn expansions() {
        assert_eq!(
            expand_nodelist("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(expand_nodelist("a,b").unwrap(), ["a", "b"]);
        assert_eq!(
            expand_nodelist("gpu-[3-5]").unwrap(),
            ["gpu-3", "gpu-4", "gpu-5"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]-n[1-2],login").unwrap(),
            ["r1-n1", "r1-n2", "r2-n1", "r2-n2", "login"]
        );
        assert_eq!(expand_nodelist("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
    }

    #[test]
    fn malformed_lists_are_refused() {
        for bad in [
            "node[01-04",
            "node01-04]",
            "n[a-b]",
            "n[5-3]",
            "",
            "a,,b",
            "n[[1]]",
            "n[1-]",
        ] {
            assert!(expand_nodelist(bad).is_err(), "{bad}");
            assert!(first_host(bad).is_err(), "{bad}");
        }
        assert!(expand_nodelist("n[0-99999]")
            .unwrap_err()
            .contains("more than"));
    }
}
