//! The Shakespeare split on the plays carried in `datasets/shakespeare/`.

use canopy_engine::data::{
    Part, VOCABULARY_SIZE, char_index, load_shakespeare, most_frequent_character_baseline,
};

const PLAYS: &str = "../datasets/shakespeare";

#[test]
fn the_plays_split_into_speaking_roles() {
    let roles = load_shakespeare(PLAYS).expect("the plays load");
    let plays: std::collections::BTreeSet<&str> = roles.iter().map(|r| r.play.as_str()).collect();
    assert_eq!(
        plays.len(),
        37,
        "every play has roles, the poems none: {plays:?}"
    );
    assert!(
        (1_200..1_500).contains(&roles.len()),
        "about 1,370 roles, got {}",
        roles.len()
    );
    let lear = roles
        .iter()
        .find(|r| r.play == "lear" && r.speaker == "LEAR")
        .expect("Lear speaks in King Lear");
    assert_eq!(lear.lines[0], "Attend the lords of France and Burgundy,");
    let hamlet = roles
        .iter()
        .find(|r| r.play == "hamlet" && r.speaker == "HAM")
        .expect("Hamlet speaks in Hamlet, as `Ham.`");
    assert!(hamlet.lines.len() > 1_000, "{}", hamlet.lines.len());
    assert!(
        hamlet
            .lines
            .iter()
            .any(|l| l.contains("To be, or not to be")),
        "Hamlet's soliloquy is his"
    );
    for role in &roles {
        for line in &role.lines {
            assert!(
                !line.contains('[') && !line.contains(']'),
                "{}/{}: {line}",
                role.play,
                role.speaker
            );
        }
    }
    let spoken = || {
        roles
            .iter()
            .flat_map(|r| r.lines.iter())
            .flat_map(|l| l.chars())
    };
    let unknown: String = spoken().filter(|&c| char_index(c) == 0).collect();
    let all = spoken().count();
    assert!(
        unknown.len() * 100_000 < all,
        "the vocabulary covers all but a handful of {all} spoken characters: {unknown:?}"
    );
}

#[test]
fn a_roles_test_part_is_its_last_lines() {
    let roles = load_shakespeare(PLAYS).expect("the plays load");
    let kent = roles
        .iter()
        .find(|r| r.play == "lear" && r.speaker == "KENT")
        .expect("Kent speaks in King Lear");
    let train = kent.text(Part::Train);
    let test = kent.text(Part::Test);
    assert_eq!(format!("{train}{test}"), kent.lines.join("\n") + "\n");
    assert_eq!(test.lines().count(), kent.lines.len() / 5);
    let samples = kent
        .next_character_samples(Part::Test, 80)
        .expect("windows");
    assert_eq!(samples.len(), test.chars().count() - 80);
    assert_eq!(samples.feature_shape(), &[80]);
    assert_eq!(samples.num_classes(), VOCABULARY_SIZE);
}

#[test]
fn a_folder_without_plays_is_named() {
    let empty = std::env::temp_dir().join(format!("canopy-no-plays-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("temp folder");
    let error = load_shakespeare(&empty).expect_err("no plays").to_string();
    assert!(error.contains("no plays found"), "{error}");
    std::fs::remove_dir_all(&empty).ok();
}

/// The figure a `charlm` must beat: always predicting a space is right
/// on 16.3 % of the test parts' next characters (sequence length 80).
#[test]
fn the_most_frequent_character_baseline() {
    let roles = load_shakespeare(PLAYS).expect("the plays load");
    let (character, accuracy) = most_frequent_character_baseline(&roles, 80);
    assert_eq!(character, ' ');
    assert!((accuracy - 0.1629).abs() < 0.0005, "{accuracy}");
}
