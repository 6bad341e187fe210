//! The AWS shared config and credentials files (`~/.aws/config`, `~/.aws/credentials`),
//! read as the AWS CLI reads them, for what the environment does not say: a profile's
//! keys, region and endpoint. Environment variables win over the files. Pure: the
//! caller reads the files.

use std::collections::BTreeMap;

/// The settings of one profile, by the environment variable each stands for
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
/// `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`).
pub type Settings = BTreeMap<&'static str, String>;

const KEYS: &[(&str, &str)] = &[
    ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
    ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
    ("aws_session_token", "AWS_SESSION_TOKEN"),
    ("region", "AWS_DEFAULT_REGION"),
    ("endpoint_url", "AWS_ENDPOINT_URL"),
];

/// The settings of `profile` in a credentials file (sections `[name]`) and a config
/// file (sections `[profile name]`, `[default]` for the default profile); the
/// credentials file wins where both say something.
pub fn profile_settings(profile: &str, credentials: &str, config: &str) -> Settings {
    let mut out = Settings::new();
    let config_section = if profile == "default" {
        "default".to_string()
    } else {
        format!("profile {profile}")
    };
    for (text, section) in [(config, config_section.as_str()), (credentials, profile)] {
        for (key, value) in section_pairs(text, section) {
            if let Some((_, var)) = KEYS.iter().find(|(name, _)| *name == key) {
                out.insert(var, value);
            }
        }
    }
    out
}

/// The `key = value` pairs of `[section]` in an INI text (comments `#`/`;`, nested
/// `s3 =` blocks' indented lines skipped).
fn section_pairs(text: &str, section: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            continue; // a nested setting (`s3 =` followed by indented lines)
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside {
            if let Some((key, value)) = line.split_once('=') {
                out.push((key.trim().to_ascii_lowercase(), value.trim().to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_come_from_both_files_credentials_winning() {
        let credentials = "[default]\naws_access_key_id = AK\naws_secret_access_key=SK\n\n[other]\naws_access_key_id = OK\n";
        let config = "[default]\nregion = eu-west-1\naws_access_key_id = IGNORED\n[profile other]\nregion = us-east-2\nendpoint_url = http://127.0.0.1:7480\ns3 =\n  addressing_style = path\n";
        let default = profile_settings("default", credentials, config);
        assert_eq!(default["AWS_ACCESS_KEY_ID"], "AK");
        assert_eq!(default["AWS_SECRET_ACCESS_KEY"], "SK");
        assert_eq!(default["AWS_DEFAULT_REGION"], "eu-west-1");
        let other = profile_settings("other", credentials, config);
        assert_eq!(other["AWS_ACCESS_KEY_ID"], "OK");
        assert_eq!(other["AWS_ENDPOINT_URL"], "http://127.0.0.1:7480");
        assert!(!other.contains_key("AWS_SECRET_ACCESS_KEY"));
        assert_eq!(other.len(), 3);
    }

    #[test]
    fn comments_and_unknown_keys_are_ignored() {
        let text = "# c\n; c\n[default]\nfoo = bar\nregion=x # not a comment in values\n";
        let settings = profile_settings("default", "", text);
        assert_eq!(settings.len(), 1);
        assert_eq!(
            settings["AWS_DEFAULT_REGION"],
            "x # not a comment in values"
        );
    }
}
