"""The teaching kit around kvt: course assignments and their autograder, smaller siblings of a checkpoint
to study transfer on (family), and a small -> large cascade (cascade). Nothing else imports it."""
