//! The benches' command lines, parsed one way for all: `--flag value` pairs and `--switch`es
//! (no clap in the benches). A bad command line is a message on stderr and exit status 2.

use std::str::FromStr;

/// The arguments after the program name, walked flag by flag.
pub struct Flags {
    args: std::vec::IntoIter<String>,
}

impl Flags {
    /// The process's arguments.
    pub fn from_env() -> Flags {
        Flags {
            args: std::env::args().skip(1).collect::<Vec<_>>().into_iter(),
        }
    }

    /// The next flag; `--bench` (which cargo passes to harness-less benches) is passed over.
    pub fn next_flag(&mut self) -> Option<String> {
        self.args.by_ref().find(|a| a != "--bench")
    }

    /// The value that follows `flag`.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        self.args.next().ok_or(format!("{flag} needs a value"))
    }

    /// The value that follows `flag`, as a number.
    pub fn number<T: FromStr>(&mut self, flag: &str) -> Result<T, String> {
        let v = self.value(flag)?;
        v.parse()
            .map_err(|_| format!("{flag} needs a number, not '{v}'"))
    }
}

/// The error for a flag the bench does not know.
pub fn unknown(flag: &str) -> String {
    format!("unknown flag {flag}")
}

/// What `parse` makes of the process's arguments; on an error, `bench: error` on stderr and
/// exit status 2.
pub fn parse_or_exit<T>(bench: &str, parse: impl FnOnce(&mut Flags) -> Result<T, String>) -> T {
    match parse(&mut Flags::from_env()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{bench}: {e}");
            std::process::exit(2);
        }
    }
}
