"""Short real-text passages for agreement measurements (prose, facts, instructions, dialogue,
code, lists), written for this project. Quantisation agreement is measured on these instead of
random token ids: a trained model is confident on real text, which is where a lost top-1 shows.
"""

from __future__ import annotations

PASSAGES = (
    "The capital of France is Paris, a city known for its museums, its cafes and the tower "
    "built for the 1889 World's Fair.",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so it boils at a lower temperature.",
    "To make a cup of tea, bring fresh water to the boil, pour it over the leaves and let them "
    "steep for three to five minutes before removing them.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n",
    "The mitochondria is often called the powerhouse of the cell because it produces most of "
    "the energy the cell needs.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who went "
    "out every morning before sunrise.",
    "User: What is the tallest mountain in the world?\nAssistant: The tallest mountain above "
    "sea level is Mount Everest, at about 8,849 metres.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to produce glucose and oxygen.",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n    else:\n",
    "The meeting has been moved to Thursday at three o'clock. Please let me know if that time "
    "does not work for you.",
    "The Pacific Ocean is the largest and deepest of the Earth's oceans, covering more than "
    "sixty million square miles.",
    "Ingredients: two cups of flour, one teaspoon of salt, three eggs and one cup of milk. "
    "Mix the dry ingredients first.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon, followed shortly by "
    "Buzz Aldrin.",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the "
    "English alphabet.",
    "A healthy diet includes plenty of fruits and vegetables, whole grains, and lean sources "
    "of protein such as fish and beans.",
    "Dear Sir or Madam,\nI am writing to apply for the position of assistant librarian "
    "advertised on your website.",
    "The French Revolution began in 1789 and led to the end of the monarchy and the rise of "
    "Napoleon Bonaparte.",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\n",
    "Step 1: Open the settings menu. Step 2: Select the network tab. Step 3: Choose your "
    "wireless network and enter the password.",
    "The human heart has four chambers: two atria on top and two ventricles below, which pump "
    "blood to the lungs and the body.",
    "It was a bright cold day in April, and the clocks were striking thirteen as she walked "
    "home through the empty streets.",
    "Question: How many continents are there?\nAnswer: There are seven continents: Africa, "
    "Antarctica, Asia, Australia, Europe, North America and South America.",
    "The speed of light in a vacuum is about 299,792 kilometres per second, and nothing with "
    "mass can travel faster.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Regular exercise strengthens the heart, improves mood and helps people sleep better at "
    "night.",
    "The Great Wall of China stretches for thousands of kilometres across the northern part of "
    "the country.",
    "Please remember to bring your passport, your boarding pass and a copy of your hotel "
    "reservation to the airport.",
    "Shakespeare wrote many famous plays, including Hamlet, Macbeth, Othello and Romeo and "
    "Juliet.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates "
    "and slowing growth.",
    "<html>\n  <head>\n    <title>My Page</title>\n  </head>\n  <body>\n",
    "Bees play an important role in agriculture because they pollinate many of the crops that "
    "people eat.",
    "User: Can you recommend a good book?\nAssistant: If you enjoy science fiction, you might "
    "like Dune by Frank Herbert.",
    "The Amazon rainforest produces a large share of the world's oxygen and is home to "
    "millions of species of plants and animals.",
    "A triangle has three sides and three angles, and the sum of its interior angles is always "
    "180 degrees.",
    "The train to London leaves at half past eight from platform four and arrives just before "
    "ten.",
    "Machine learning is a field of computer science in which systems learn patterns from "
    "data instead of being explicitly programmed.",
    "git add .\ngit commit -m \"Fix the login bug\"\ngit push origin main\n",
    "Winter in Canada can be very cold, with temperatures often falling below minus twenty "
    "degrees in January.",
    "The library will be closed on Monday for the public holiday and will reopen on Tuesday "
    "morning at nine.",
    "Albert Einstein developed the theory of relativity, one of the two pillars of modern "
    "physics.",
    "To reset your password, click on the link in the email we sent you and follow the "
    "instructions on the page.",
    "The Nile is one of the longest rivers in the world and flows north through eleven "
    "countries into the Mediterranean Sea.",
    "function add(a, b) {\n  return a + b;\n}\n\nconsole.log(add(2, 3));\n",
    "Elephants are the largest land animals on Earth, and they can live for more than sixty "
    "years in the wild.",
    "Thank you for your order! Your package has been shipped and should arrive within three "
    "to five business days.",
    "The Roman Empire was one of the largest empires of the ancient world, with Rome as its "
    "capital.",
    "Question: What is the chemical symbol for gold?\nAnswer: The chemical symbol for gold is "
    "Au, from the Latin word aurum.",
    "Sleep is essential for good health. Most adults need between seven and nine hours of "
    "sleep each night.",
    "The old house at the end of the street had been empty for years, and the children said it "
    "was haunted.",
    "A computer's central processing unit executes instructions, while its memory stores the "
    "data and programs in use.",
    "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa and attracts thousands "
    "of climbers every year.",
    "The recipe calls for butter, sugar and eggs, which should be beaten together until the "
    "mixture is light and fluffy.",
    "User: Translate 'good morning' into Spanish.\nAssistant: 'Good morning' in Spanish is "
    "'buenos dias'.",
    "Earthquakes happen when rocks beneath the surface suddenly break along a fault and release "
    "stored energy.",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "The committee will review all applications and announce the results at the end of the "
    "month.",
    "Jupiter is the largest planet in our solar system, with a mass more than three hundred "
    "times that of the Earth.",
    "When you arrive at the hotel, the receptionist will ask for your name and a form of "
    "identification.",
    "Vitamin C is found in citrus fruits such as oranges and lemons, and it helps the body "
    "heal wounds.",
    "The first computers filled entire rooms, but today a phone in your pocket is many times "
    "more powerful.",
    "Dogs have been companions to humans for thousands of years and were among the first "
    "animals to be domesticated.",
    "In conclusion, the results of the study suggest that regular reading improves vocabulary "
    "and concentration in children.",
    "The sun rises in the east and sets in the west because the Earth rotates from west to "
    "east.",
)
