//! The Shakespeare next-character task of the FedAvg paper (McMahan et al.
//! 2017) and LEAF: each client is a speaking role, a character in one
//! play, and its lines are split in order, the first 80 % to train on and
//! the rest to test on. A sample is `sequence_len` characters, as indices
//! into [`CHARACTERS`], and its label the character that follows.
//!
//! The plays are read as Project Gutenberg's 1998 etexts print them
//! (`datasets/shakespeare/`): front matter up to the first `ACT` line, then
//! blocks separated by blank lines. A block whose first line is a
//! speaker's name (`Kent.`, `Alb. and Corn.`, `FIRST SERVANT.`, or in
//! capitals without the stop, `EGEUS`) starts that speaker's speech;
//! a block without one continues the speech before it (a song, lines
//! after a stage direction). Stage directions (`[Exit.]`, `[Aside.]`) are
//! dropped, and `ACT` and `SCENE` lines end the current speech. Works
//! with no `ACT` line (the sonnets and the poems) have no roles.

use std::collections::BTreeMap;
use std::path::Path;

use super::data_err;
use super::dataset::Dataset;
use super::dir::list_files;
use super::limits::{DataBounds, MAX_ELEMENTS, MAX_SAMPLES};
use super::read::DataFile;
use crate::error::EngineResult;

/// The characters a sample is written in: a character's index is its
/// position here plus one, and index 0 stands for any other character.
/// All but 24 of the plays' 4.2 M spoken characters are here (the
/// rest are `_`, `*`, `/`, `@`, braces).
pub const CHARACTERS: &str =
    "\n !\"&'(),-.0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// How many classes a next character has: [`CHARACTERS`] and "other".
pub const VOCABULARY_SIZE: usize = CHARACTERS.len() + 1;

/// Longest line a play's file may have, in bytes.
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// Longest speaker's name, in characters: a longer first line of a block
/// is speech.
pub const MAX_SPEAKER_CHARS: usize = 40;

/// Most plays in one folder.
pub const MAX_PLAYS: usize = 1_000;

/// Longest sample, in characters.
pub const MAX_SEQUENCE_LEN: usize = 4_096;

/// Share of each role's lines, from its end, held out to test on.
pub const TEST_FRACTION_DENOMINATOR: usize = 5;

/// Lower-case words a speaker's name may hold (`Alb. and Corn.`).
const NAME_CONNECTORS: [&str; 6] = ["and", "of", "the", "de", "du", "le"];

/// One speaking role: a character in one play, with its lines in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Role {
    /// The play's file name without `_gut.txt[.gz]`, e.g. `lear`.
    pub play: String,
    /// The speaker's name in capitals, without the stop, e.g. `KENT`.
    pub speaker: String,
    pub lines: Vec<String>,
}

/// Which part of a role's lines: the first 80 % or the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Train,
    Test,
}

impl Role {
    /// How many of the lines, from the start, are for training: all but
    /// the last fifth (rounded down).
    pub fn train_lines(&self) -> usize {
        train_lines(&self.lines)
    }

    /// The part's text: its lines, each ended by a line break.
    pub fn text(&self, part: Part) -> String {
        part_text(&self.lines, part)
    }

    /// Every window of `sequence_len` characters of the part's text, each
    /// labelled with the character after it (see [`next_character_samples`]).
    pub fn next_character_samples(&self, part: Part, sequence_len: usize) -> EngineResult<Dataset> {
        let origin = format!("{}/{}", self.play, self.speaker);
        next_character_samples(Path::new(&origin), &self.text(part), sequence_len)
    }
}

/// How many of `lines`, from the start, are for training: all but the last
/// fifth (rounded down). The one split of a text, for a role of the plays
/// and for a device's own text alike: in order, so that no test window
/// shares characters with a training one.
pub fn train_lines(lines: &[String]) -> usize {
    lines.len() - lines.len() / TEST_FRACTION_DENOMINATOR
}

/// The part's text: its lines, each ended by a line break.
pub fn part_text(lines: &[String], part: Part) -> String {
    let split = train_lines(lines);
    let lines = match part {
        Part::Train => &lines[..split],
        Part::Test => &lines[split..],
    };
    let mut text = String::new();
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    text
}

/// Every window of `sequence_len` characters of `text`, each labelled with
/// the character after it; features are indices into [`CHARACTERS`] (see
/// [`char_index`]), shape `[sequence_len]`. Empty when the text is not
/// longer than one window. Errors name `origin`.
pub fn next_character_samples(
    origin: &Path,
    text: &str,
    sequence_len: usize,
) -> EngineResult<Dataset> {
    if !(1..=MAX_SEQUENCE_LEN).contains(&sequence_len) {
        let cause =
            format!("sequence length {sequence_len} must be between 1 and {MAX_SEQUENCE_LEN}");
        return Err(data_err(origin, cause));
    }
    let indices: Vec<f32> = text.chars().map(|c| char_index(c) as f32).collect();
    let samples = indices.len().saturating_sub(sequence_len);
    let values = samples.saturating_mul(sequence_len);
    if samples > MAX_SAMPLES || values > MAX_ELEMENTS {
        let cause = format!(
            "{samples} windows of {sequence_len} characters are more than a dataset may hold \
             ({MAX_SAMPLES} samples, {MAX_ELEMENTS} values)"
        );
        return Err(data_err(origin, cause));
    }
    let mut features = Vec::with_capacity(values);
    let mut labels = Vec::with_capacity(samples);
    for start in 0..samples {
        features.extend_from_slice(&indices[start..start + sequence_len]);
        labels.push(indices[start + sequence_len] as i64);
    }
    Dataset::new(features, vec![sequence_len], labels, VOCABULARY_SIZE)
}

/// The lines of a UTF-8 text file (`.gz` or plain), under the default
/// [`DataBounds`]; a line longer than [`MAX_LINE_BYTES`] or a file that is
/// not UTF-8 is refused, naming the file.
pub fn read_text_lines(path: impl AsRef<Path>) -> EngineResult<Vec<String>> {
    let path = path.as_ref();
    let mut file = DataFile::open(path, &DataBounds::DEFAULT)?;
    let mut lines = Vec::new();
    let mut raw = Vec::new();
    while file.read_line(&mut raw, MAX_LINE_BYTES)? {
        let line = std::str::from_utf8(&raw)
            .map_err(|_| data_err(path, "not UTF-8 text; hint: save the file as UTF-8"))?;
        lines.push(line.trim_end_matches(['\r', '\n']).to_string());
    }
    if lines.is_empty() {
        return Err(data_err(path, "the file holds no text"));
    }
    Ok(lines)
}

/// The baseline a next-character model must beat: the share of the test
/// parts' labels (every character after the first `sequence_len` of a
/// role's test text) that equal the training parts' most frequent
/// character, with that character.
pub fn most_frequent_character_baseline(roles: &[Role], sequence_len: usize) -> (char, f64) {
    let mut train_counts = vec![0u64; VOCABULARY_SIZE];
    for role in roles {
        for character in role.text(Part::Train).chars() {
            train_counts[char_index(character)] += 1;
        }
    }
    let commonest = (0..VOCABULARY_SIZE)
        .max_by_key(|&index| train_counts[index])
        .unwrap_or(0);
    let (mut hits, mut labels) = (0u64, 0u64);
    for role in roles {
        for character in role.text(Part::Test).chars().skip(sequence_len) {
            labels += 1;
            hits += u64::from(char_index(character) == commonest);
        }
    }
    let character = commonest
        .checked_sub(1)
        .and_then(|position| CHARACTERS.chars().nth(position))
        .unwrap_or('\u{fffd}');
    (character, hits as f64 / labels.max(1) as f64)
}

/// A character's index: its position in [`CHARACTERS`] plus one, or 0.
pub fn char_index(character: char) -> usize {
    CHARACTERS
        .find(character)
        .map_or(0, |position| position + 1)
}

/// Every speaking role of the plays in `dir` (`*.txt` or `*.txt.gz`, read
/// in name order), in play order and then by speaker, under the default
/// [`DataBounds`] for all the files together.
pub fn load_shakespeare(dir: impl AsRef<Path>) -> EngineResult<Vec<Role>> {
    let dir = dir.as_ref();
    let mut names: Vec<String> = list_files(dir)?
        .into_iter()
        .filter(|name| name.ends_with(".txt") || name.ends_with(".txt.gz"))
        .collect();
    names.sort();
    if names.is_empty() {
        let cause = "no plays found: expected the plays as *.txt or *.txt.gz files";
        return Err(data_err(dir, cause));
    }
    if names.len() > MAX_PLAYS {
        let cause = format!("{} plays, more than the {MAX_PLAYS} allowed", names.len());
        return Err(data_err(dir, cause));
    }
    let mut roles = Vec::new();
    let mut previous: Option<DataFile> = None;
    for name in names {
        let path = dir.join(&name);
        let mut file = match &previous {
            None => DataFile::open(&path, &DataBounds::DEFAULT)?,
            Some(before) => before.open_next(&path)?,
        };
        roles.extend(read_play(&mut file, play_name(&name))?);
        previous = Some(file);
    }
    Ok(roles)
}

/// `lear_gut.txt.gz` → `lear`.
fn play_name(file_name: &str) -> String {
    let stem = file_name.trim_end_matches(".gz").trim_end_matches(".txt");
    stem.strip_suffix("_gut").unwrap_or(stem).to_string()
}

/// The roles of one play, by speaker.
fn read_play(file: &mut DataFile, play: String) -> EngineResult<Vec<Role>> {
    let path = file.path().to_path_buf();
    let mut parser = PlayParser::default();
    let mut raw = Vec::new();
    while file.read_line(&mut raw, MAX_LINE_BYTES)? {
        let line = std::str::from_utf8(&raw)
            .map_err(|_| data_err(&path, "not UTF-8 text: a play is plain text"))?;
        parser.line(line);
    }
    parser.end_block();
    Ok(parser
        .speeches
        .into_iter()
        .filter(|(_, lines)| !lines.is_empty())
        .map(|(speaker, lines)| Role {
            play: play.clone(),
            speaker,
            lines,
        })
        .collect())
}

/// Reads a play line by line: see the module's documentation.
#[derive(Default)]
struct PlayParser {
    /// Whether the first `ACT` line has been seen.
    in_acts: bool,
    block: Vec<String>,
    speaker: Option<String>,
    speeches: BTreeMap<String, Vec<String>>,
}

impl PlayParser {
    fn line(&mut self, line: &str) {
        let trimmed = line.trim();
        if !self.in_acts {
            self.in_acts = starts_act(trimmed);
            return;
        }
        if trimmed.is_empty() {
            self.end_block();
        } else {
            self.block.push(trimmed.to_string());
        }
    }

    fn end_block(&mut self) {
        let block = std::mem::take(&mut self.block);
        let Some(first) = block.first() else {
            return;
        };
        if is_act_or_scene(first) {
            self.speaker = None;
            return;
        }
        let body = match speaker_name(first) {
            Some(name) if block.len() >= 2 => {
                self.speaker = Some(name);
                &block[1..]
            }
            _ => &block[..],
        };
        let Some(speaker) = &self.speaker else {
            return;
        };
        let spoken = without_directions(&body.join("\n"));
        let lines = self.speeches.entry(speaker.clone()).or_default();
        lines.extend(
            spoken
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .map(str::to_string),
        );
    }
}

fn starts_act(line: &str) -> bool {
    line.starts_with("ACT ") || line.starts_with("Act ")
}

fn is_act_or_scene(line: &str) -> bool {
    starts_act(line) || line.starts_with("SCENE ") || line.starts_with("Scene ")
}

/// The text without its bracketed stage directions (one left open runs
/// to the end).
fn without_directions(text: &str) -> String {
    let mut kept = String::with_capacity(text.len());
    let mut depth = 0usize;
    for character in text.chars() {
        match character {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            _ if depth == 0 => kept.push(character),
            _ => {}
        }
    }
    kept
}

/// The speaker a line names, in capitals without the stop, if it is a
/// speaker's name: words that start with a capital or a digit (or are
/// [`NAME_CONNECTORS`]) ending in a stop (`Alb. and Corn.`), or capitals
/// alone without one (`EGEUS`).
fn speaker_name(line: &str) -> Option<String> {
    if line.chars().count() > MAX_SPEAKER_CHARS {
        return None;
    }
    let name = match line.strip_suffix('.') {
        Some(name) if name.split([' ', '-']).all(is_name_word) => name,
        Some(_) => return None,
        None if is_capitals_name(line) => line,
        None => return None,
    };
    Some(name.to_uppercase())
}

fn is_name_word(word: &str) -> bool {
    let mut characters = word.chars();
    let Some(first) = characters.next() else {
        return false;
    };
    NAME_CONNECTORS.contains(&word)
        || ((first.is_ascii_uppercase() || first.is_ascii_digit())
            && characters.all(|c| c.is_ascii_alphanumeric() || c == '\'' || c == '.'))
}

fn is_capitals_name(line: &str) -> bool {
    let starts_well = line
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_uppercase() || c.is_ascii_digit());
    starts_well
        && line.ends_with(|c: char| c.is_ascii_uppercase())
        && line
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || " '&-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> BTreeMap<String, Vec<String>> {
        let mut parser = PlayParser::default();
        for line in text.lines() {
            parser.line(line);
        }
        parser.end_block();
        parser.speeches
    }

    #[test]
    fn speeches_go_to_their_speakers_without_directions() {
        let play = "THE TRAGEDY\n\nPersons Represented.\n\nLear, King.\nKent.\n\nACT I.\n\
                    Scene I. A room.\n\nKent.\nSee better, Lear;\n\nLear.\nO vassal!\n\n\
                    [Laying his hand on his sword.]\n\nAlb. and Corn.\nDear sir, forbear!\n\n\
                    Kent.\nFare thee well.\n[To Cordelia.] The gods keep thee, maid,\n\n\
                    [Exit.]\n\nAnd more.\n\nSCENE II. A field.\n\nOrphan line.\n\n\
                    EGEUS\nHappy be Theseus!\n";
        let speeches = parse(play);
        assert_eq!(
            speeches["KENT"],
            [
                "See better, Lear;",
                "Fare thee well.",
                "The gods keep thee, maid,",
                "And more."
            ]
        );
        assert_eq!(speeches["LEAR"], ["O vassal!"]);
        assert_eq!(speeches["ALB. AND CORN"], ["Dear sir, forbear!"]);
        assert_eq!(speeches["EGEUS"], ["Happy be Theseus!"]);
        assert_eq!(
            speeches.len(),
            4,
            "front matter and a line after SCENE are no one's: {speeches:?}"
        );
    }

    #[test]
    fn a_sentence_is_not_a_speaker() {
        assert_eq!(speaker_name("First Servant."), Some("FIRST SERVANT".into()));
        assert_eq!(speaker_name("2 MURDERER."), Some("2 MURDERER".into()));
        assert_eq!(
            speaker_name("Here comes the almanac of my true date."),
            None
        );
        assert_eq!(
            speaker_name("Away."),
            Some("AWAY".into()),
            "alone in its block it is speech, see end_block"
        );
        assert_eq!(speaker_name("Saddle my horse."), None);
        assert_eq!(speaker_name("O, I am slain!"), None);
        assert_eq!(speaker_name(&"A".repeat(MAX_SPEAKER_CHARS + 1)), None);
    }

    #[test]
    fn a_one_line_block_continues_the_speech() {
        let speeches = parse("ACT I.\n\nKent.\nFirst.\n\nAway.\n");
        assert_eq!(speeches["KENT"], ["First.", "Away."]);
        assert!(!speeches.contains_key("AWAY"));
    }

    #[test]
    fn lines_split_in_order_and_windows_predict_the_next_character() {
        let role = Role {
            play: "p".into(),
            speaker: "S".into(),
            lines: (0..10).map(|i| format!("line {i}")).collect(),
        };
        assert_eq!(role.train_lines(), 8);
        assert_eq!(role.text(Part::Test), "line 8\nline 9\n");
        let test = role.next_character_samples(Part::Test, 4).expect("windows");
        assert_eq!(test.len(), 14 - 4);
        let (first, label) = test.sample(0).expect("a sample");
        let expected: Vec<f32> = "line".chars().map(|c| char_index(c) as f32).collect();
        assert_eq!(first, expected.as_slice());
        assert_eq!(label, char_index(' ') as i64);
        assert_eq!(char_index('~'), 0);
        assert!(role.next_character_samples(Part::Test, 0).is_err());
        assert!(
            role.next_character_samples(Part::Test, 100)
                .expect("none")
                .is_empty()
        );
    }
}
